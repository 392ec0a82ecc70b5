"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's multipart form, checked here, relayed to vLLM.

The upload is bounded before the model sees it: its size, that it is audio soundfile (libsndfile) reads (WAV,
FLAC, OGG, MP3), its decoded duration and its sample rate, read from the file's headers. Every other form field
goes to vLLM as sent, which judges what the gateway does not bound (language, prompt, temperature, ...).

OpenAI answers `response_format=text` in plain text; vLLM 0.32 answers it in JSON, so the gateway unwraps it. vLLM
refuses srt and vtt: the gateway asks it for verbose_json and writes its segments as SubRip (the `srt` library) or
WebVTT (`webvtt-py`) cues; a model that predicts no timestamps has no segments, and so no cues.
"""

from __future__ import annotations

import asyncio
import io

from core.contract import AUDIO_SUFFIXES, SPEECH_RECOGNITION

from ..backends.base import Upload
from ..exceptions import InvalidRequest
from ..settings import GatewaySettings
from ..state import GatewayState

TASK = SPEECH_RECOGNITION
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
SUBTITLES = {"srt", "vtt"}  # written here from vLLM's verbose_json segments
AUDIO_FORMATS = ", ".join(suffix[1:].upper() for suffix in AUDIO_SUFFIXES)


def check_audio(limits: GatewaySettings, audio: Upload) -> None:
    """A 400 naming why, unless the upload is audio within the bounds."""
    import soundfile

    if not audio.data:
        raise InvalidRequest("file is empty", param="file")
    if len(audio.data) > limits.max_audio_bytes:
        raise InvalidRequest(f"file is {len(audio.data)} bytes; this gateway allows at most {limits.max_audio_bytes}",
                             param="file")
    try:
        info = soundfile.info(io.BytesIO(audio.data))
    except (RuntimeError, TypeError, ValueError):  # soundfile's LibsndfileError is a RuntimeError
        raise InvalidRequest(f"file {audio.filename!r} is not audio this gateway reads ({AUDIO_FORMATS})",
                             param="file") from None
    if info.frames <= 0 or info.samplerate <= 0:
        raise InvalidRequest(f"file {audio.filename!r} holds no audio samples", param="file")
    low, high = limits.audio_khz
    if not low * 1000 <= info.samplerate <= high * 1000:
        raise InvalidRequest(f"file {audio.filename!r} is sampled at {info.samplerate} Hz; this gateway takes "
                             f"{low:g} to {high:g} kHz", param="file")
    seconds = info.frames / info.samplerate
    if seconds > limits.max_audio_seconds:
        raise InvalidRequest(f"file {audio.filename!r} is {seconds:.1f} s long; this gateway allows at most "
                             f"{limits.max_audio_seconds:g} s", param="file")


def check_fields(fields: list[tuple[str, str]]) -> dict[str, str]:
    """The form's single-valued fields by name (a list field such as timestamp_granularities[] may repeat)."""
    found: dict[str, str] = {}
    for name, value in fields:
        if name in found and not name.endswith("[]"):
            raise InvalidRequest(f"form field {name!r} is given more than once", param=name)
        found[name] = value
    if not found.get("model"):
        raise InvalidRequest("the form has no model field", param="model")
    response_format = found.get("response_format", "json")
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(f"response_format {response_format!r} is not served here; valid: "
                             f"{', '.join(RESPONSE_FORMATS)}", param="response_format")
    if found.get("stream", "false").lower() not in ("false", "0"):
        raise InvalidRequest("streamed transcriptions are not relayed by this gateway yet: leave stream out",
                             param="stream")
    if "temperature" in found:
        try:
            temperature = float(found["temperature"])
        except ValueError:
            raise InvalidRequest(f"temperature {found['temperature']!r} is not a number", param="temperature") from None
        if not 0.0 <= temperature <= 1.0:
            raise InvalidRequest(f"temperature is {temperature:g}; OpenAI's audio API takes 0 to 1", param="temperature")
    return found


async def transcribe(state: GatewayState, path: str, fields: list[tuple[str, str]], audio: Upload) -> dict | str:
    """The backend's answer to the form: a dict (json, verbose_json) or the text (response_format text)."""
    found = check_fields(fields)
    info = await state.dispatch.resolve(found["model"], TASK)
    # off the event loop: libsndfile counts an MP3's frames by reading it through
    await asyncio.to_thread(check_audio, state.settings, audio)
    response_format = found.get("response_format", "json")
    if response_format in SUBTITLES:
        fields = [(k, "verbose_json" if k == "response_format" else v) for k, v in fields]
    answer = await state.dispatch.call(info, lambda b, m: b.transcribe(path, fields, audio, m.name))
    if response_format in SUBTITLES:
        return subtitles(answer.get("segments") or [], response_format)
    return answer.get("text", "") if response_format == "text" else answer


def subtitles(segments: list[dict], response_format: str) -> str:
    """verbose_json's segments (start and end in seconds, text) as an srt or a vtt file."""
    if response_format == "srt":
        import datetime

        import srt

        return srt.compose([srt.Subtitle(i, datetime.timedelta(seconds=s["start"]), datetime.timedelta(seconds=s["end"]),
                                         s["text"].strip()) for i, s in enumerate(segments, 1)])
    import webvtt
    from webvtt.models import Timestamp

    return webvtt.WebVTT(captions=[webvtt.Caption(str(Timestamp.from_seconds(s["start"])),
                                                  str(Timestamp.from_seconds(s["end"])), s["text"].strip())
                                   for s in segments]).content


# Deep readiness (state.py): a quarter second of silence, transcribed (one token at most).
def _silence() -> bytes:
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(b"\0\0" * 4_000)
    return buffer.getvalue()


CANARY_AUDIO = Upload(_silence(), "canary.wav", "audio/wav")
CANARIES = {TASK: lambda backend, model, timeout: backend.transcribe(
    "/v1/audio/transcriptions", [("model", model.name), ("max_completion_tokens", "1")], CANARY_AUDIO, model.name)}

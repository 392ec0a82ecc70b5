"""The speech routes' checks and relay, in process with a fake vLLM (the real one: tests/integration/test_speech_e2e.py)."""

import io
import wave

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.backends.base import Backend, ModelInfo
from serve.gateway.settings import GatewaySettings

from .fakes import error_of


def _wav(seconds: float, rate: int = 16_000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\1" * int(seconds * rate))
    return buffer.getvalue()


class FakeWhisper(Backend):
    """Answers every form with its file's size; records (path, fields, filename) of each call."""

    kind = "vllm"

    def __init__(self):
        self.url, self.calls = "fake", []

    async def discover(self):
        return [ModelInfo("whisper", "automatic-speech-recognition", "vllm", True),
                ModelInfo("llm", "text-generation", "vllm", True)]

    async def transcribe(self, path, fields, audio, model):
        self.calls.append((path, fields, audio.filename))
        answer = {"text": f" {len(audio.data)} bytes", "usage": {"type": "duration", "seconds": 1}}
        if ("response_format", "verbose_json") in fields:
            answer["segments"] = [{"id": 0, "start": 0.0, "end": 2.5, "text": " Hello there."},
                                  {"id": 1, "start": 2.5, "end": 3661.25, "text": " An hour later."}]
        return answer


@pytest.fixture
def client():
    backend = FakeWhisper()
    settings = GatewaySettings(health_interval_s=60, max_audio_seconds=10, max_audio_bytes=400_000)
    with TestClient(create_app(settings, [backend])) as c:
        c.backend = backend
        yield c


def test_the_form_is_relayed_as_sent_and_text_is_plain(client):
    audio = _wav(1.0)
    fields = {"model": "whisper", "language": "de", "prompt": "Fachbegriffe", "temperature": "0.2"}
    answer = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", audio)},
                         data={**fields, "timestamp_granularities[]": ["segment", "word"]})
    assert answer.status_code == 200 and answer.json()["text"] == f" {len(audio)} bytes"
    path, sent, filename = client.backend.calls[-1]
    assert path == "/v1/audio/transcriptions" and filename == "a.wav"
    assert sorted(sent) == sorted([*fields.items(), ("timestamp_granularities[]", "segment"),
                                   ("timestamp_granularities[]", "word")])
    text = client.post("/v1/audio/translations", files={"file": ("a.wav", audio)},
                       data={"model": "whisper", "response_format": "text"})
    assert text.headers["content-type"].startswith("text/plain") and text.text == f" {len(audio)} bytes"
    assert client.backend.calls[-1][0] == "/v1/audio/translations"


def test_srt_and_vtt_are_written_from_the_models_timed_segments(client):
    import srt
    import webvtt

    answer = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(1.0))},
                         data={"model": "whisper", "response_format": "srt"})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    assert ("response_format", "verbose_json") in client.backend.calls[-1][1]  # what vLLM can answer
    cues = list(srt.parse(answer.text))
    assert [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in cues] == [
        (0.0, 2.5, "Hello there."), (2.5, 3661.25, "An hour later.")]
    assert "01:01:01,250" in answer.text
    vtt = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(1.0))},
                      data={"model": "whisper", "response_format": "vtt"}).text
    captions = webvtt.from_buffer(io.StringIO(vtt))
    assert [(c.start, c.end, c.text) for c in captions] == [("00:00:00.000", "00:00:02.500", "Hello there."),
                                                            ("00:00:02.500", "01:01:01.250", "An hour later.")]


@pytest.mark.parametrize("files, data, param, message", [
    ({"file": ("a.wav", b"")}, {}, "file", "file is empty"),
    ({"file": ("a.mp4", b"\0\0\0\x18ftypmp42")}, {}, "file", "'a.mp4' is not audio this gateway reads"),
    ({"file": ("a.wav", _wav(11))}, {}, "file", "11.0 s long; this gateway allows at most 10 s"),
    ({"file": ("a.wav", _wav(12.6))}, {}, "file", "bytes; this gateway allows at most 400000"),
    ({"file": ("a.wav", _wav(0.5, 4000))}, {}, "file", "sampled at 4000 Hz; this gateway takes 8 to 192 kHz"),
    ({"file": ("a.wav", _wav(0.5))}, {"response_format": "csv"}, "response_format", "'csv' is not served here"),
    ({"file": ("a.wav", _wav(0.5))}, {"stream": "true"}, "stream", "not relayed by this gateway yet"),
    ({"file": ("a.wav", _wav(0.5))}, {"temperature": "hot"}, "temperature", "'hot' is not a number"),
    ({"file": ("a.wav", _wav(0.5))}, {"temperature": "-1"}, "temperature", "0 to 1"),
    ({"file": ("a.wav", _wav(0.5))}, {"language": ["en", "de"]}, "language", "given more than once"),
    ({}, {}, "file", "one audio file, in the field `file`"),
    ({"audio": ("a.wav", _wav(0.5))}, {}, "file", "one audio file, in the field `file`"),
    ({"file": ("a.wav", _wav(0.5))}, {"model": "llm"}, "model", "is a text-generation model"),
    ({"file": ("a.wav", _wav(0.5))}, {"model": ""}, "model", "no model field"),
])
def test_bad_forms_are_400_naming_the_field_and_never_reach_the_model(client, files, data, param, message):
    error = error_of(client.post("/v1/audio/transcriptions", files=files, data={"model": "whisper", **data}), 400)
    assert message in error["message"] and error["param"] == param, error
    assert client.backend.calls == []


def test_a_json_body_is_a_clear_400(client):
    error = error_of(client.post("/v1/audio/transcriptions", json={"model": "whisper", "file": "a.wav"}), 400)
    assert "one audio file" in error["message"]


def test_a_client_that_leaves_cancels_the_work_for_it():
    import asyncio

    from serve.gateway.edge.orjson_route import unless_client_leaves
    from serve.gateway.exceptions import ClientGone

    class Request:
        def __init__(self, leaves_after_s):
            self.leaves_after_s = leaves_after_s

        async def receive(self):
            await asyncio.sleep(self.leaves_after_s)
            return {"type": "http.disconnect"}

    async def work(seconds, log):
        try:
            await asyncio.sleep(seconds)
            return "answer"
        except asyncio.CancelledError:
            log.append("cancelled")
            raise

    async def main():
        log = []
        assert await unless_client_leaves(Request(5.0), work(0.01, log)) == "answer"
        with pytest.raises(ClientGone):
            await unless_client_leaves(Request(0.01), work(5.0, log))
        await asyncio.sleep(0)  # the cancellation lands in the work at its next step
        return log

    assert asyncio.run(main()) == ["cancelled"]

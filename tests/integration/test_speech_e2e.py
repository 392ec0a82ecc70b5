"""Speech to text through the real gateway to the real vLLM server: the fixture Whisper (trained on espeak-ng's
speech), exported by `rtxserve export speech`, called with the official `openai` SDK and held to transformers' own
pipeline on the same audio."""

import io
import re

import httpx
import numpy as np
import openai
import pytest

from fixture_models.speech import SPEECH_RATE, SPEECH_SENTENCES, WINDOW_S, write_whisper
from export.speech.whisper import export_speech, pipeline_transcripts
from deploy.load import parse_deployment
from serve.launcher import free_port
from tests.integration import VLLM_EAGER, routes_not_through_the_gateway

MODEL = "tiny-whisper"
MAX_AUDIO_SECONDS = 40


def _wav(samples: np.ndarray, rate: int = SPEECH_RATE, fmt: str = "WAV") -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(the fixture's folder, the exported package): parity.json holds the pipeline's transcripts of its audio."""
    work = tmp_path_factory.mktemp("whisper")
    source = write_whisper(work / "source")
    return source, export_speech(source, work / "package", sample_audio=source / "audio", name=MODEL).out


@pytest.fixture(scope="module")
def servers(whisper, tmp_path_factory):
    """(gateway URL, vLLM URL): the box that a deployment file naming the package as a speech model brings up, as
    `rtxserve serve up` does (the planner, vLLM's command and the gateway's settings from the file)."""
    from deploy.box import down, up

    work = tmp_path_factory.mktemp("speech-box")
    ports = {"gateway": free_port(), "vllm": free_port()}
    d = parse_deployment({"name": "speech-box", "ports": ports,
                          "gateway": {"settings": {"max_audio_seconds": MAX_AUDIO_SECONDS}},
                          "models": [{"name": MODEL, "kind": "speech", "path": str(whisper[1]), "max_num_seqs": 4,
                                      "vllm_args": VLLM_EAGER}]}, work)
    run = up(d, root=work / "runs", log=lambda line: None)
    try:
        yield f"http://127.0.0.1:{ports['gateway']}", f"http://127.0.0.1:{ports['vllm']}"
    finally:
        down(run, log=lambda line: None)


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_whisper_trained_too_briefly_is_refused_by_its_build(tmp_path):
    from fixture_models.training import FixtureError

    with pytest.raises(FixtureError, match="did not learn that it transcribes each sentence's clip.* in 1 steps"):
        write_whisper(tmp_path / "whisper", train_steps=1, rounds=1)
    assert not (tmp_path / "whisper" / "config.json").exists()


def test_the_model_is_listed_as_speech(servers):
    models = httpx.get(f"{servers[0]}/v1/models").json()["data"]
    assert [(m["id"], m["task"]) for m in models] == [(MODEL, "automatic-speech-recognition")]


def test_transcripts_equal_the_pipeline_and_vllm_direct(servers, whisper):
    import json

    reference = json.loads((whisper[1] / "parity.json").read_text())["transcripts"]
    # the fixture's build checked that it transcribes each clip as its sentence, with a margin
    assert sorted(reference.values()) == sorted(SPEECH_SENTENCES)
    gateway, direct = _sdk(servers[0]), _sdk(servers[1])
    for name, expected in reference.items():
        path = whisper[0] / "audio" / name
        served = gateway.audio.transcriptions.create(file=path.open("rb"), model=MODEL, language="en", temperature=0)
        assert served.text == expected, name
        assert direct.audio.transcriptions.create(file=path.open("rb"), model=MODEL, language="en").text == expected
    # response_format text is plain text, as OpenAI answers it (vLLM answers JSON; the gateway unwraps it)
    name, expected = next(iter(reference.items()))
    text = gateway.audio.transcriptions.create(file=(whisper[0] / "audio" / name).open("rb"), model=MODEL,
                                               language="en", response_format="text")
    assert text == expected
    # srt is written from vLLM's verbose_json segments: a cue for each segment vLLM answers, with its text and times
    # (the fixture's build checked that, asked for timestamps, it writes the sentence and then its end's timestamp)
    import srt

    path = whisper[0] / "audio" / name
    subtitles = gateway.audio.transcriptions.create(file=path.open("rb"), model=MODEL, language="en",
                                                    response_format="srt")
    segments = direct.audio.transcriptions.create(file=path.open("rb"), model=MODEL, language="en",
                                                  response_format="verbose_json").segments
    assert [segment.text.strip() for segment in segments] == [expected.strip()]
    assert isinstance(subtitles, str)
    assert [(cue.content, cue.start.total_seconds(), cue.end.total_seconds()) for cue in srt.parse(subtitles)] == \
        [(segment.text.strip(), round(segment.start, 3), round(segment.end, 3)) for segment in segments]


def test_other_formats_and_rates_are_read(servers, whisper):
    """FLAC, OGG and a WAV at 44.1 kHz (vLLM resamples it) answer what the pipeline answers of the same audio (the
    fixture's build checked that it transcribes the lossy and the resampled forms as the clip, with a margin)."""
    import soundfile
    from scipy.signal import resample_poly

    samples, rate = soundfile.read(whisper[0] / "audio" / "02.wav", dtype="float32")
    expected = pipeline_transcripts(whisper[1], [whisper[0] / "audio" / "02.wav"])["02.wav"]
    sdk = _sdk(servers[0])
    for name, data in [("a.flac", _wav(samples, fmt="FLAC")), ("a.ogg", _wav(samples, fmt="OGG")),
                       ("a.wav", _wav(resample_poly(samples, 441, 160).astype("float32"), 44_100))]:
        assert sdk.audio.transcriptions.create(file=(name, data), model=MODEL, language="en").text == expected, name


def test_audio_longer_than_30_s_is_transcribed_whole(servers, whisper):
    """Four sentences in 33 s of audio: vLLM cuts audio longer than the processor's window (the fixture's 10 s) at
    the quietest 0.1 s of each window's last second and joins the windows' transcripts, so all four arrive, in order.
    The reference: the pipeline on each sentence alone. (The fixture learnt sentences that start its window, so the
    quietest 0.1 s, true silence in an inaudible hiss, is put just before each sentence: the cut falls there.)"""
    import soundfile

    names = ["00.wav", "05.wav", "02.wav", "04.wav"]
    audio = np.random.RandomState(0).normal(0, 1e-4, SPEECH_RATE * 33).astype("float32")
    window = at = 0  # where vLLM's window starts, where the sentence does
    for i, name in enumerate(names):
        clip, _ = soundfile.read(whisper[0] / "audio" / name, dtype="float32")
        if i:
            window += int(SPEECH_RATE * (WINDOW_S - 0.3))  # the 8th of the 0.1 s slots vLLM looks at
            audio[window:window + SPEECH_RATE // 10] = 0
            at = window + SPEECH_RATE // 10
        audio[at:at + len(clip)] = clip
    reference = pipeline_transcripts(whisper[1], [whisper[0] / "audio" / n for n in names])
    served = _sdk(servers[0]).audio.transcriptions.create(file=("long.wav", _wav(audio)), model=MODEL, language="en")
    assert served.text.split() == " ".join(reference[n] for n in names).split()


def test_translations_relay(servers, whisper):
    path = whisper[0] / "audio" / "03.wav"
    answers = [_sdk(url).audio.translations.create(file=path.open("rb"), model=MODEL, temperature=0) for url in servers]
    assert answers[0].text == answers[1].text  # the fixture was never taught to translate: vLLM's own answer, relayed


@pytest.mark.parametrize("case, param, message", [
    ("empty", "file", "file is empty"),
    ("not audio", "file", "is not audio this gateway reads"),
    ("too long", "file", f"at most {MAX_AUDIO_SECONDS} s"),
    ("low rate", "file", "sampled at 4000 Hz"),
    ("csv", "response_format", "response_format 'csv' is not served here"),
    ("language", "language", "Unsupported language: 'xx'"),
    ("no file", "file", "one audio file"),
    ("temperature", "temperature", "0 to 1"),
])
def test_bad_uploads_are_400_naming_what(servers, whisper, case, param, message):
    good = (whisper[0] / "audio" / "01.wav").read_bytes()
    files, data = {"file": ("a.wav", good)}, {"model": MODEL}
    if case == "empty":
        files = {"file": ("a.wav", b"")}
    elif case == "not audio":
        files = {"file": ("a.wav", b"RIFF....WAVE but not really audio")}
    elif case == "too long":
        files = {"file": ("a.wav", _wav(np.zeros(SPEECH_RATE * (MAX_AUDIO_SECONDS + 1), dtype="float32")))}
    elif case == "low rate":
        files = {"file": ("a.wav", _wav(np.zeros(4000, dtype="float32"), 4000))}
    elif case == "csv":
        data["response_format"] = "csv"
    elif case == "language":
        data["language"] = "xx"
    elif case == "no file":
        files = {}
    elif case == "temperature":
        data["temperature"] = "1.5"
    response = httpx.post(f"{servers[0]}/v1/audio/transcriptions", files=files, data=data, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] in (param, None), error


def test_a_speech_model_is_not_a_chat_model(servers):
    response = httpx.post(f"{servers[0]}/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "automatic-speech-recognition model" in response.json()["error"]["message"]


def test_the_transcribe_load_test_reports_the_real_time_factor(servers, whisper, tmp_path):
    from loadtest.runner import LoadSpec, run, scenario_options

    options = scenario_options(scenario="transcribe", model=MODEL, audio_dir=str(whisper[0] / "audio"), language="en")
    # every request counted (no warm-up): beside the other test worker, two AVX2 cores transcribe only a few in 6 s
    s = run(LoadSpec(servers[0], options, users=2, duration_s=6, warmup_s=0), tmp_path / "report",
            log=lambda m: None).summary
    assert s.requests >= 2 and s.errors == 0, s.error_kinds
    speech = s.speech
    assert speech["requests"] == s.requests and speech["audio_s"] > 1.5 * speech["requests"]  # clips of 2 to 3 s
    assert 0 < speech["per_request_rtf"]["p1"] <= speech["per_request_rtf"]["p50"]
    assert "real-time factor of" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.parametrize("defect, message", [
    ("adapter", "no adapter weights in"),
    ("architecture", "a speech export needs WhisperForConditionalGeneration"),
    ("mel bins", "makes 80 mel bins and the model takes 128"),
    ("no processor", "no processor in"),
    ("no generation config", "no generation_config.json"),
    ("special tokens", "lacks Whisper's special token(s) <|notimestamps|>"),
    ("truncated", "model.safetensors"),
])
def test_export_refuses_what_vllm_or_the_pipeline_cannot_use(whisper, tmp_path, defect, message):
    import json
    import shutil

    from export.exceptions import ExportError

    source = shutil.copytree(whisper[0], tmp_path / "source", ignore=shutil.ignore_patterns("audio"))
    config = json.loads((source / "config.json").read_text())
    if defect == "adapter":
        (source / "adapter_config.json").write_text("{}")
    elif defect == "architecture":
        (source / "config.json").write_text(json.dumps({**config, "architectures": ["WhisperForAudioClassification"]}))
    elif defect == "mel bins":
        (source / "config.json").write_text(json.dumps({**config, "num_mel_bins": 128}))
    elif defect == "no processor":
        (source / "processor_config.json").unlink()
    elif defect == "no generation config":
        (source / "generation_config.json").unlink()
    elif defect == "special tokens":
        tokenizer = json.loads((source / "tokenizer.json").read_text())
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<|notimestamps|>"]
        (source / "tokenizer.json").write_text(json.dumps(tokenizer))
    elif defect == "truncated":
        weights = source / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ExportError, match=re.escape(message)):
        export_speech(source, tmp_path / "package")
    assert not (tmp_path / "package").exists()


def test_a_lora_on_the_whisper_is_merged_with_parity_and_packaged(whisper, tmp_path):
    """A PEFT LoRA on the fixture's attention (random, so that it changes the model) exported as its base's folder
    is: merged, reloaded and held to base + adapter on the sample audio, then transcribed by the pipeline."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import WhisperForConditionalGeneration

    from export.exceptions import ExportError

    torch.manual_seed(0)
    model = get_peft_model(WhisperForConditionalGeneration.from_pretrained(whisper[0]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")  # records its base: the fixture's folder
    with pytest.raises(ExportError, match="--base applies to a LoRA adapter"):
        export_speech(whisper[0], tmp_path / "wrong", base=whisper[0])
    done = export_speech(tmp_path / "adapter", tmp_path / "merged", sample_audio=whisper[0] / "audio")
    parity = json.loads((done.out / "parity.json").read_text())
    merge = parity["merge"]
    assert merge["passed"] and merge["cases"] == 1 and merge["outputs"]["logits"]["max_abs_diff"] <= 1e-3
    assert done.metadata["merged"]["adapter_effect_max_abs"] > 0.1  # the adapter is not a no-op
    assert done.metadata["merged"]["base"] == str(whisper[0].resolve()) and done.metadata["merged"]["rank"] == 4
    assert sorted(parity["transcripts"]) == sorted(p.name for p in (whisper[0] / "audio").iterdir())
    assert not any(done.out.glob("adapter_*"))  # a standalone Whisper, as vLLM loads it
    config = json.loads((done.out / "config.json").read_text())
    assert config["architectures"] == ["WhisperForConditionalGeneration"]
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()), "base_model_name_or_path": "/nowhere"}))
    with pytest.raises(ExportError, match="is not a local folder"):
        export_speech(tmp_path / "adapter", tmp_path / "none")


def test_every_route_a_whisper_engine_serves_is_relayed_or_refused_with_its_reason(servers):
    assert routes_not_through_the_gateway(*servers) == []


def test_the_served_whisper_transcribes_its_reference_set_as_the_pipeline_did(servers, whisper):
    """`rtxserve eval` on the package: its reference set (the sample audio with the pipeline's transcripts, written by
    the export) sent as OpenAI's transcription uploads through the gateway."""
    from core.reference import ReferenceSet
    from loadtest.eval.run import evaluate

    ref = ReferenceSet.read(whisper[1])
    assert [i.input["filename"] for i in ref.items] == sorted(p.name for p in (whisper[0] / "audio").iterdir())
    result = evaluate(servers[0], MODEL, ref)
    assert result.passed and all(a.agrees for a in result.answers), (result.verdict(), [a.detail for a in result.answers])

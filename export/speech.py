"""`rtxserve export speech`: a Whisper fine-tune (WhisperForConditionalGeneration, save_pretrained) -> a folder vLLM
serves on /v1/audio/transcriptions and /v1/audio/translations.

Checked before anything is written: the architecture, every weight file's integrity, the processor (Whisper's
feature extractor: vLLM cuts audio into its `chunk_length` and resamples to its `sampling_rate`), the tokenizer and
its special tokens (the prompt vLLM writes is `<|startoftranscript|><|xx|><|transcribe|><|notimestamps|>`), and the
generation config transformers' pipeline decodes with. With `sample_audio`, transformers'
`pipeline("automatic-speech-recognition")` transcribes each file greedily and its transcripts are saved as the
package's parity.json: the text the served model must answer (tests/integration/test_speech_e2e.py holds it to it).

Not yet: a PEFT LoRA on a Whisper (merge it with peft's merge_and_unload first).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from core.contract import AUDIO_SUFFIXES
from core.tasks import SPEECH_RECOGNITION

from .checkpoint import read_json
from .exceptions import ExportError
from .llm import _copy, _package, _side_files, _weight_files, _write_metadata
from .progress import Steps

log = logging.getLogger(__name__)

ARCHITECTURE = "WhisperForConditionalGeneration"
# The tokens vLLM's Whisper prompt is made of, beside one per language.
PROMPT_TOKENS = ("<|startoftranscript|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>", "<|endoftext|>")


@dataclass(frozen=True)
class SpeechExport:
    out: Path
    metadata: dict
    seconds: float
    serve_command: str


def inspect_whisper(path: Path) -> dict:
    """Check that `path` is a Whisper vLLM can serve and the pipeline can run (no weights loaded); its facts."""
    if not path.is_dir():
        raise ExportError(f"model folder not found: {path}" if not path.exists() else f"{path} is not a directory")
    if (path / "adapter_config.json").is_file():
        raise ExportError(f"{path} is a PEFT adapter; a LoRA on a Whisper is not exported yet: merge it into its base "
                          "(peft's merge_and_unload, then save_pretrained) and export the merged folder")
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} is not a Hugging Face model folder: no config.json")
    config = read_json(path / "config.json", "checkpoint")
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ExportError(f"{path / 'config.json'} names architectures {', '.join(map(str, architectures)) or '(none)'}; "
                          f"a speech export needs {ARCHITECTURE}")
    weights = _weight_files(path)
    features = _feature_extractor(path)
    if features.get("feature_extractor_type") != "WhisperFeatureExtractor":
        raise ExportError(f"the processor in {path} has a {features.get('feature_extractor_type')}, "
                          "not a WhisperFeatureExtractor")
    if features.get("feature_size") != config.get("num_mel_bins"):
        raise ExportError(f"the feature extractor makes {features.get('feature_size')} mel bins and the model takes "
                          f"{config.get('num_mel_bins')}: save the processor the model was trained with")
    if not (path / "tokenizer.json").is_file() and not (path / "vocab.json").is_file():
        raise ExportError(f"no tokenizer in {path}: save the tokenizer beside the model (processor.save_pretrained)")
    if not (path / "generation_config.json").is_file():
        raise ExportError(f"no generation_config.json in {path}: save the model with its generation config (it names "
                          "the language and task tokens transformers' pipeline decodes with)")
    generation = read_json(path / "generation_config.json", "generation config")
    languages = sorted(code.strip("<|>") for code in generation.get("lang_to_id") or {})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = tokenizer.get_vocab()
    missing = [t for t in (*PROMPT_TOKENS, *(f"<|{c}|>" for c in languages)) if t not in vocab]
    if missing:
        raise ExportError(f"the tokenizer in {path} lacks Whisper's special token(s) {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''}: vLLM writes them in every prompt")
    return {"architecture": ARCHITECTURE, "weights": weights, "languages": languages,
            "chunk_length_s": features.get("chunk_length"), "sampling_rate": features.get("sampling_rate"),
            "max_target_positions": config.get("max_target_positions")}


def _feature_extractor(path: Path) -> dict:
    """The feature extractor's settings: preprocessor_config.json (transformers 4), or processor_config.json's
    `feature_extractor` (transformers 5 saves the processor whole)."""
    if (path / "preprocessor_config.json").is_file():
        return read_json(path / "preprocessor_config.json", "processor")
    if (path / "processor_config.json").is_file():
        found = read_json(path / "processor_config.json", "processor").get("feature_extractor")
        if isinstance(found, dict):
            return found
    raise ExportError(f"no processor in {path} (preprocessor_config.json or processor_config.json): save it beside "
                      "the model (WhisperProcessor.save_pretrained); vLLM computes the audio features with it")


def pipeline_transcripts(model: Path, files: list[Path], language: str | None = "en") -> dict[str, str]:
    """transformers' own pipeline("automatic-speech-recognition") on each file, greedy: file name -> transcript.
    Audio is read with soundfile and handed over at its own rate (the pipeline resamples what is not 16 kHz)."""
    import soundfile
    from transformers import pipeline

    asr = pipeline("automatic-speech-recognition", model=str(model), device="cpu")
    found = {}
    for file in files:
        samples, rate = soundfile.read(file, dtype="float32", always_2d=True)
        kwargs = {"language": language, "task": "transcribe"} if language else {"task": "transcribe"}
        found[file.name] = asr({"raw": samples.mean(axis=1), "sampling_rate": rate},
                               generate_kwargs={**kwargs, "do_sample": False, "num_beams": 1})["text"]
    return found


def export_speech(source: str | Path, out: str | Path, *, sample_audio: Path | None = None, name: str | None = None,
                  force: bool = False, command: str = "") -> SpeechExport:
    """Check the Whisper at `source` and package it into `out` (see the module's docstring)."""
    source, out = Path(source).expanduser(), Path(out).expanduser()
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to replace it")
    steps = Steps(3 + (sample_audio is not None), log)
    steps("checking the Whisper in %s", source)
    facts = inspect_whisper(source)
    files = []
    if sample_audio is not None:
        files = sorted(p for p in Path(sample_audio).iterdir() if p.suffix.lower() in AUDIO_SUFFIXES) \
            if Path(sample_audio).is_dir() else []
        if not files:
            raise ExportError(f"{sample_audio} holds no {' / '.join(AUDIO_SUFFIXES)} files")
    steps("packaging %d weight file(s), the processor and the tokenizer into %s", len(facts["weights"]), out)
    with _package(out) as pkg:
        _copy([*facts["weights"], source / "config.json", *_side_files(source)], pkg)
        if files:
            steps("transcribing %d sample file(s) with transformers' pipeline (greedy), the served model's reference",
                  len(files))
            parity = {"reference": "transformers pipeline('automatic-speech-recognition'), greedy, language en",
                      "transcripts": pipeline_transcripts(pkg, files)}
            (pkg / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
        metadata = {"kind": "speech", "task": SPEECH_RECOGNITION, "source": str(source.resolve()),
                    **{k: v for k, v in facts.items() if k != "weights"}, "command": command}
        _write_metadata(pkg, metadata)
    served = name or out.name
    serve_command = f"rtxserve serve vllm {out} --served-model-name {served}"
    steps("done: %s", out)
    return SpeechExport(out, metadata, steps.seconds, serve_command)

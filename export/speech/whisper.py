"""`rtxserve export speech`: a Whisper fine-tune (WhisperForConditionalGeneration, save_pretrained) -> a folder vLLM
serves on /v1/audio/transcriptions and /v1/audio/translations.

Checked before anything is written: the architecture, every weight file's integrity, the processor (Whisper's
feature extractor: vLLM cuts audio into its `chunk_length` and resamples to its `sampling_rate`), the tokenizer and
its special tokens (the prompt vLLM writes is `<|startoftranscript|><|xx|><|transcribe|><|notimestamps|>`), and the
generation config transformers' pipeline decodes with. With `sample_audio`, transformers'
`pipeline("automatic-speech-recognition")` transcribes each file greedily and its transcripts are saved as the
package's parity.json: the text the served model must answer (tests/integration/test_speech_e2e.py holds it to it).

A PEFT LoRA on a Whisper (its adapter folder; the base it records, or `base`) is checked against the base (the one
LoRA fit check), merged into it (peft's merge_and_unload), saved with the base's processor and tokenizer, reloaded
and held to base + adapter: their logits on the sample audio (or on a synthetic tone without it) within `atol`,
recorded under parity.json's "merge". The merged model is then packaged as any Whisper is.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core import lora
from core.contract import AUDIO_SUFFIXES
from core.tasks import SPEECH_RECOGNITION

from ..checkpoint import read_json
from ..exceptions import ExportError
from ..llm.package import copy_files, package_folder, side_files, weight_files, write_metadata
from ..lora_adapter import base_folder, read_lora
from ..parity import ParityReport
from ..progress import Steps

log = logging.getLogger(__name__)

ARCHITECTURE = "WhisperForConditionalGeneration"
# The tokens vLLM's Whisper prompt is made of, beside one per language.
MERGE_ATOL = 1e-3  # merged vs base + adapter, both float32
MERGE_SAMPLES = 4  # sample files the merge is checked on
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
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} is not a Hugging Face model folder: no config.json")
    config = read_json(path / "config.json", "checkpoint")
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ExportError(f"{path / 'config.json'} names architectures {', '.join(map(str, architectures)) or '(none)'}; "
                          f"a speech export needs {ARCHITECTURE}")
    weights = weight_files(path)
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


def pipeline_transcripts(model: Path, files: list[Path] | dict[str, bytes], language: str | None = "en") -> dict[str, str]:
    """transformers' own pipeline("automatic-speech-recognition") on each file (or each name's bytes), greedy: file
    name -> transcript. Audio is read with soundfile and handed over at its own rate (the pipeline resamples what is
    not 16 kHz)."""
    import io

    import soundfile
    from transformers import pipeline

    asr = pipeline("automatic-speech-recognition", model=str(model), device="cpu")
    found = {}
    audio = files if isinstance(files, dict) else {f.name: f for f in files}
    for name, file in audio.items():
        samples, rate = soundfile.read(io.BytesIO(file) if isinstance(file, bytes) else file, dtype="float32",
                                       always_2d=True)
        kwargs = {"language": language, "task": "transcribe"} if language else {"task": "transcribe"}
        found[name] = asr({"raw": samples.mean(axis=1), "sampling_rate": rate},
                               generate_kwargs={**kwargs, "do_sample": False, "num_beams": 1})["text"]
    return found


def speech_reference(model: Path, items: list, *, source: Path, made_from: str, language: str | None = "en",
                     texts: list[str] | None = None):
    """A Whisper's reference (core/reference.py): transformers' own pipeline's greedy transcript of each recording
    (`texts`, where the export's parity check has made them already)."""
    from core.reference import ReferenceSet

    from ..reference import versions

    if texts is None:
        audio = {f"{i}-{item.input.get('filename', 'audio')}": base64.b64decode(item.input["audio"])
                 for i, item in enumerate(items)}
        texts = list(pipeline_transcripts(model, audio, language).values())
    return ReferenceSet(task="automatic-speech-recognition", framework=versions("transformers"), source=str(source),
                        made_from=made_from, settings={"language": language} if language else {},
                        items=[i.model_copy(update={"expect": {"text": t}}) for i, t in zip(items, texts)])


def _reference(pkg: Path, source: Path, files: list[Path], transcripts: dict | None, eval_set: Path | None) -> dict | None:
    """The package's reference set written into it, from the eval set's recordings or the sample audio (whose
    transcripts the parity check made); what rtxserve.json names it by, or None where there are no recordings."""
    from core.reference import Item, ReferenceError

    from ..reference import eval_items

    items = eval_items(eval_set, SPEECH_RECOGNITION)
    if items is None and not files:
        log.info("note: no reference set (give --eval-set or --sample-audio recordings): `rtxserve eval` of this model "
                 "needs --eval-set")
        return None
    texts = None
    if items is None:
        items = [Item(input={"audio": base64.b64encode(f.read_bytes()).decode(), "filename": f.name}) for f in files]
        texts = [transcripts[f.name] for f in files]
    ref = speech_reference(pkg, items, source=source.resolve(), made_from=str(eval_set) if eval_set else "sample audio",
                           texts=texts)
    try:
        return ref.write(pkg)
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


def _read(files: list[Path], rate: int) -> list[np.ndarray]:
    """Each file's samples, mono, at `rate` (soundfile reads them; SciPy's polyphase filter resamples)."""
    import soundfile
    from scipy.signal import resample_poly

    out = []
    for file in files:
        samples, found = soundfile.read(file, dtype="float32", always_2d=True)
        mono = samples.mean(axis=1)
        out.append(resample_poly(mono, rate, found).astype(np.float32) if found != rate else mono)
    return out


def merge_lora(adapter_dir: Path, base: Path | None, into: Path, samples: list[Path], *, atol: float = MERGE_ATOL,
               steps: Steps) -> dict:
    """The LoRA at `adapter_dir` merged into its Whisper base and saved in `into` with the base's processor and
    tokenizer; reloaded and held to base + adapter (ExportError beyond `atol`). Returns what the metadata records."""
    import torch
    from peft import PeftModel
    from transformers import AutoFeatureExtractor, AutoTokenizer, WhisperForConditionalGeneration

    adapter = read_lora(adapter_dir)
    base = Path(base_folder(adapter, base)).expanduser()
    steps("checking the adapter %s against its Whisper base %s", adapter.path, base)
    inspect_whisper(base)
    try:
        lora.check_fit(adapter.path, adapter.config, adapter.shapes, base, lora.tensor_shapes(weight_files(base)),
                       read_json(base / "config.json", "checkpoint"), for_vllm=False)
    except lora.AdapterFitError as exc:
        raise ExportError(f"{exc} (--base)") from None
    extractor, tokenizer = AutoFeatureExtractor.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    rate = extractor.sampling_rate
    audio = _read(samples[:MERGE_SAMPLES], rate) if samples else [  # without samples: two seconds of a chord
        sum(np.sin(2 * np.pi * f * np.arange(2 * rate) / rate) for f in (220, 330, 440)).astype(np.float32) / 3]
    features = torch.from_numpy(extractor(audio, sampling_rate=rate, return_tensors="np").input_features)
    prompt = torch.tensor([tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                                                            "<|notimestamps|>"])] * len(audio))

    def logits(model) -> np.ndarray:
        with torch.no_grad():
            return model(input_features=features, decoder_input_ids=prompt).logits.numpy()

    model = PeftModel.from_pretrained(WhisperForConditionalGeneration.from_pretrained(base, dtype=torch.float32),
                                      adapter.path).eval()
    reference = logits(model)
    with model.disable_adapter():
        effect = float(np.abs(reference - logits(model)).max())
    steps("merging (merge_and_unload); comparing the reloaded model's logits with base + adapter on %d input(s)",
          len(audio))
    model.merge_and_unload().save_pretrained(into, safe_serialization=True)
    copy_files([f for f in side_files(base) if not (into / f.name).exists()], into)
    report = ParityReport(atol=atol)
    report.add({"logits": reference}, {"logits": logits(WhisperForConditionalGeneration.from_pretrained(into).eval())})
    report.notes.append(f"the adapter itself moves the base's logits by up to {effect:.3g} (max abs)")
    report.check(allow_drift=False)
    return {"adapter": str(adapter.path.resolve()), "base": str(base.resolve()), "rank": adapter.rank,
            "target_modules": list(adapter.targets), "adapter_effect_max_abs": effect,
            "inputs": f"{len(audio)} sample file(s)" if samples else "a synthetic 2 s chord", "parity": report.to_dict()}


def export_speech(source: str | Path, out: str | Path, *, sample_audio: Path | None = None, base: Path | None = None,
                  name: str | None = None, force: bool = False, command: str = "",
                  eval_set: Path | None = None) -> SpeechExport:
    """Check the Whisper (or the LoRA on one) at `source` and package it into `out` (see the module's docstring), with
    its reference set where there are recordings to make one of (`eval_set`, else `sample_audio`)."""
    source, out = Path(source).expanduser(), Path(out).expanduser()
    if out.exists() and not force:
        raise ExportError(f"{out} exists; pass --force to replace it")
    is_adapter = (source / "adapter_config.json").is_file()
    if base is not None and not is_adapter:
        raise ExportError(f"--base applies to a LoRA adapter; {source} has no adapter_config.json")
    steps = Steps(3 + (sample_audio is not None) + 2 * is_adapter, log)
    files = []
    if sample_audio is not None:
        files = sorted(p for p in Path(sample_audio).iterdir() if p.suffix.lower() in AUDIO_SUFFIXES) \
            if Path(sample_audio).is_dir() else []
        if not files:
            raise ExportError(f"{sample_audio} holds no {' / '.join(AUDIO_SUFFIXES)} files")
    with package_folder(out) as pkg:
        merged = merge_lora(source, base, pkg, files, steps=steps) if is_adapter else None
        model = pkg if merged else source
        steps("checking the Whisper in %s", model)
        facts = inspect_whisper(model)
        steps("packaging %d weight file(s), the processor and the tokenizer into %s", len(facts["weights"]), out)
        if not merged:
            copy_files([*facts["weights"], source / "config.json", *side_files(source)], pkg)
        parity = {"merge": merged.pop("parity")} if merged else {}
        if files:
            steps("transcribing %d sample file(s) with transformers' pipeline (greedy), the served model's reference",
                  len(files))
            parity |= {"reference": "transformers pipeline('automatic-speech-recognition'), greedy, language en",
                       "transcripts": pipeline_transcripts(pkg, files)}
        if parity:
            (pkg / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
        reference = _reference(pkg, source, files, parity.get("transcripts"), eval_set)
        metadata = {"kind": "speech", "task": SPEECH_RECOGNITION, "source": str(source.resolve()),
                    **({"merged": merged} if merged else {}), **{k: v for k, v in facts.items() if k != "weights"},
                    "command": command, **({"reference": reference} if reference else {})}
        write_metadata(pkg, metadata)
    served = name or out.name
    serve_command = f"rtxserve serve vllm {out} --served-model-name {served}"
    steps("done: %s", out)
    return SpeechExport(out, metadata, steps.seconds, serve_command)

"""`rtxserve export llm`: LLaMA-Factory (and plain Hugging Face) LLM outputs -> folders vLLM serves.

Three kinds of source:
- a full fine-tune (config.json + weights): checked (architecture, every weight file's integrity,
  tokenizer, chat template, dtype) and packaged;
- a LoRA / QLoRA adapter (adapter_config.json) packaged as a vLLM LoRA module: checked against its
  base (every LoRA tensor's shape against the base's layer, target modules vLLM can serve);
- the same adapter with `merge=True`: merged into its base (peft `merge_and_unload`) as a standalone
  model; the merged model, reloaded from disk, is compared with base+adapter on sample prompts and the
  figures are saved as parity.json. QLoRA adapters merge into the full-precision base with a warning.

Every package is built in a work folder beside the output and renamed into place at the end, so a
failure leaves nothing half-written; each carries rtxserve.json (what it is, from what, how made).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core import lora
from core.weights import WeightsIndexError, safetensors_files

from ..trainers import megatron, runs, zero
from ..triton import repository
from ..checkpoint import TOKENIZER_FILES, check_safetensors, read_json
from ..exceptions import ExportError
from ..parity import ParityReport, compare_with_trainer, first_outputs
from ..progress import Steps

log = logging.getLogger(__name__)

TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                        "added_tokens.json", "merges.txt", "generation_config.json", *("processor_config.json",
                        "preprocessor_config.json", "video_preprocessor_config.json"))
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
CAUSAL_LM = "AutoModelForCausalLM"
# Vision-language models, and how an image reaches the prompt: the chat template writes a placeholder that
# the processor expands into image tokens (Qwen-VL), or the processor puts its query tokens in itself (None).
VLM_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "<|image_pad|>",
    "Qwen2_5_VLForConditionalGeneration": "<|image_pad|>",
    "Qwen3VLForConditionalGeneration": "<|image_pad|>",
    "Blip2ForConditionalGeneration": None,
}
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# Largest rank vLLM's --max-lora-rank accepts.
SAMPLE_PROMPTS = [
    "Hello, how can I help you today?",
    "Summarise the refund policy in one sentence.",
    "the quick brown fox",
    "Écris une phrase en français, s'il te plaît.",
    "1 2 3 4 5 6 7 8 9 10 " * 6,
]
# Default tolerance on logits, by the dtype the merged model is saved in: merging rounds W + BA to it.
DEFAULT_ATOL = {"float32": 1e-3, "float16": 0.25, "bfloat16": 0.25}


@dataclass(frozen=True)
class LLMCheckpoint:
    path: Path
    config: dict
    architecture: str
    weights: tuple[Path, ...]
    dtype: str
    chat_template: bool
    vision: bool = False

    @property
    def max_model_len(self) -> int | None:
        text = self.config.get("text_config") or {}
        return self.config.get("max_position_embeddings") or text.get("max_position_embeddings")


@dataclass
class LLMExport:
    kind: str  # "full", "lora", "merged" or "quantized"
    out: Path
    metadata: dict
    serve_command: str
    seconds: float


def _weight_files(path: Path) -> tuple[Path, ...]:
    """Every weight file of a checkpoint (shards included), each checked for truncation."""
    try:
        files = tuple(safetensors_files(path))
    except WeightsIndexError as exc:
        raise ExportError(str(exc)) from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ExportError(f"{path / 'model.safetensors.index.json'} lists shards that are missing: {', '.join(missing)}")
    if not files and ((path / "pytorch_model.bin").is_file() or (path / "pytorch_model.bin.index.json").is_file()):
        raise ExportError(f"{path} holds pickled pytorch_model.bin weights; save them as safetensors "
                          "(model.save_pretrained(out, safe_serialization=True)): vLLM and rtxserve load only safetensors")
    if not files:
        raise ExportError(f"no model weights in {path}: expected model.safetensors or model.safetensors.index.json")
    for file in files:
        check_safetensors(file)
    return files


def chat_template_text(path: Path) -> str:
    """The folder's chat template (chat_template.jinja, chat_template.json or tokenizer_config.json), or ''."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name, what in (("chat_template.json", "chat template"), ("tokenizer_config.json", "tokenizer")):
        if (path / name).is_file():
            template = read_json(path / name, what).get("chat_template")
            if template:
                return template if isinstance(template, str) else json.dumps(template)
    return ""


def has_chat_template(path: Path) -> bool:
    return bool(chat_template_text(path))


def _check_vision(path: Path, architecture: str, chat_template: Path | None) -> None:
    """A vision-language model needs its image processor, and a chat template that places its images."""
    if not any((path / name).is_file() for name in PROCESSOR_FILES):
        raise ExportError(f"{architecture} in {path} has no processor config ({' or '.join(PROCESSOR_FILES)}): save the "
                          "processor beside the model (processor.save_pretrained)")
    placeholder = VLM_ARCHITECTURES[architecture]
    template = Path(chat_template).read_text() if chat_template else chat_template_text(path)
    if placeholder and placeholder not in template:
        raise ExportError(f"the chat template of {path} never writes {placeholder}, the placeholder {architecture}'s "
                          "processor turns into image tokens: images would not reach the model. Use the model's own "
                          "chat template (--chat-template FILE)")


def inspect_llm(path: str | Path, chat_template: Path | None = None) -> LLMCheckpoint:
    """Check that `path` is a causal-LM or vision-language checkpoint vLLM can serve (no weights are loaded);
    `chat_template` is the template that will replace the folder's own."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ExportError(f"model folder not found: {path}" if not path.exists() else f"{path} is not a directory")
    if not (path / "config.json").is_file():
        raise ExportError(f"{path} is not a Hugging Face model folder: no config.json "
                          "(pass the folder written by save_pretrained(), or an adapter folder with adapter_config.json)")
    config = read_json(path / "config.json", "checkpoint")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    causal = [a for a in architectures if a.endswith("ForCausalLM") or a in VLM_ARCHITECTURES]
    if not causal:
        raise ExportError(f"{path / 'config.json'} names architectures {', '.join(architectures) or '(none)'}; "
                          "an LLM export needs a *ForCausalLM model or a vision-language model "
                          f"({', '.join(VLM_ARCHITECTURES)})")
    vision = causal[0] in VLM_ARCHITECTURES
    if vision:
        _check_vision(path, causal[0], chat_template)
    quant = config.get("quantization_config")
    if quant and (quant.get("load_in_4bit") or quant.get("bnb_4bit_quant_type")):
        raise ExportError(f"{path} is a bitsandbytes 4-bit model; pass the full-precision base model instead")
    weights = _weight_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(f"no tokenizer in {path}: save the tokenizer beside the model (tokenizer.save_pretrained)")
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return LLMCheckpoint(path, config, causal[0], weights, dtype, has_chat_template(path), vision)


@dataclass(frozen=True)
class AdapterInfo:
    path: Path
    config: dict
    rank: int
    alpha: float
    targets: tuple[str, ...]
    recorded_base: str
    weights: Path
    shapes: dict[str, list[int]]


def read_lora(path: Path) -> AdapterInfo:
    try:
        config = lora.read_adapter_config(path)
    except lora.AdapterConfigError as exc:
        raise ExportError(str(exc)) from None
    weights = next((path / w for w in ADAPTER_WEIGHTS if (path / w).is_file()), None)
    if weights is None:
        raise ExportError(f"no adapter weights in {path}: expected {' or '.join(ADAPTER_WEIGHTS)}")
    if weights.suffix != ".safetensors":
        raise ExportError(f"{weights} is pickled; save the adapter with safe_serialization=True (adapter_model.safetensors)")
    shapes = check_safetensors(weights)
    targets = config.get("target_modules") or []
    rank = int(config.get("r", 8))
    return AdapterInfo(path, config, rank, float(config.get("lora_alpha", rank)),
                       tuple([targets] if isinstance(targets, str) else targets),
                       str(config.get("base_model_name_or_path") or ""), weights, shapes)


def raise_misfit(adapter: AdapterInfo, base: Path, mismatch: list[str]) -> None:
    if mismatch:
        raise ExportError(lora.misfit_message(adapter.path, adapter.recorded_base, base, mismatch) + " (--base)")


def check_lora_against_base(adapter: AdapterInfo, base: LLMCheckpoint, *, for_vllm: bool) -> None:
    """Every LoRA tensor must fit a layer of the base: a wrong base fails here with both names."""
    try:
        lora.check_fit(adapter.path, adapter.config, adapter.shapes, base.path, lora.tensor_shapes(base.weights),
                       base.config, for_vllm=for_vllm)
    except lora.AdapterFitError as exc:
        way_out = {"misfit": " (--base)", "vllm": f" in {adapter.path}; merge the adapter into its base with --merge instead"}
        raise ExportError(f"{exc}{way_out.get(exc.kind, '')}") from None


def base_folder(adapter: AdapterInfo, base: str | Path | None) -> str | Path:
    """`base` if given, else the base the adapter records, which must be a local folder (no model hub here)."""
    if base is None:
        if not adapter.recorded_base:
            raise ExportError(f"{adapter.path}/adapter_config.json records no base model; pass it with --base PATH")
        if not Path(adapter.recorded_base).expanduser().is_dir():
            raise ExportError(f"the adapter's base {adapter.recorded_base} is not a local folder (no model hub here); "
                              "pass the local copy with --base PATH")
        base = adapter.recorded_base
    return base


def resolve_base(adapter: AdapterInfo, base: str | Path | None) -> LLMCheckpoint:
    return inspect_llm(base_folder(adapter, base))


# --- packaging ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _package(out: Path) -> Iterator[Path]:
    """A folder to build the package in, on `out`'s file system, renamed to `out` on success only."""
    with repository.work_dir(out) as work:
        pkg = work / "pkg"
        pkg.mkdir()
        yield pkg
        if out.exists():
            os.replace(out, work / "retired")
        os.replace(pkg, out)


def _copy(files: list[Path], dest: Path) -> None:
    """Hard-link where possible (same file system, instant for 16 GB of shards), else copy; log sizes."""
    for file in files:
        target = dest / file.name
        try:
            os.link(file, target)
        except OSError:
            shutil.copy2(file, target)
        log.info("    %s (%.1f MB)", file.name, file.stat().st_size / 1e6)


def _side_files(path: Path) -> list[Path]:
    return [path / n for n in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES) if (path / n).is_file()]


def _versions() -> dict:
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import peft

        versions["peft"] = peft.__version__
    except ImportError:
        pass
    return versions


def _write_metadata(pkg: Path, metadata: dict) -> None:
    metadata = {**metadata, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": _versions()}
    (pkg / "rtxserve.json").write_text(json.dumps(metadata, indent=2) + "\n")


def _add_chat_template(pkg: Path, chat_template: Path | None) -> None:
    if chat_template is not None:
        try:
            text = Path(chat_template).read_text()
        except OSError as exc:
            raise ExportError(f"cannot read the chat template {chat_template}: {exc}") from exc
        (pkg / "chat_template.jinja").write_text(text)


def _warn_no_chat_template(where: Path) -> None:
    log.warning("WARNING: %s has no chat template: /v1/completions works, /v1/chat/completions will be refused by vLLM; "
                "add one with --chat-template FILE", where)


def package_full(source: LLMCheckpoint, out: Path, *, chat_template: Path | None, command: str,
                 steps: Steps, extra: dict | None = None, extra_files: tuple[Path, ...] = ()) -> dict:
    steps("packaging %d weight file(s) and the tokenizer into %s", len(source.weights), out)
    with _package(out) as pkg:
        index = source.path / "model.safetensors.index.json"
        _copy([*source.weights, *([index] if index.is_file() else []), source.path / "config.json",
               *_side_files(source.path), *extra_files], pkg)
        _add_chat_template(pkg, chat_template)
        metadata = {"kind": "full", "source": str(source.path.resolve()), "architecture": source.architecture,
                    "dtype": source.dtype, "max_model_len": source.max_model_len,
                    "chat_template": source.chat_template or chat_template is not None, "vision": source.vision,
                    "command": command, **(extra or {})}
        _write_metadata(pkg, metadata)
    return metadata


def package_lora(adapter: AdapterInfo, base: LLMCheckpoint, out: Path, *, qlora: bool, command: str,
                 steps: Steps, extra: dict | None = None) -> dict:
    steps("packaging the adapter (rank %d, targets %s) as a vLLM LoRA module into %s",
          adapter.rank, ", ".join(adapter.targets), out)
    with _package(out) as pkg:
        _copy([adapter.path / "adapter_config.json", adapter.weights, *_side_files(adapter.path)], pkg)
        metadata = {"kind": "lora", "source": str(adapter.path.resolve()), "base": str(base.path.resolve()),
                    "base_architecture": base.architecture, "rank": adapter.rank, "lora_alpha": adapter.alpha,
                    "target_modules": list(adapter.targets), "qlora": qlora, "command": command, **(extra or {})}
        _write_metadata(pkg, metadata)
    return metadata


def _prompts(tokenizer, has_template: bool, prompts: list[str]) -> list[list[int]]:
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    if has_template:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompts[0]}], add_generation_prompt=True,
                                                 tokenize=True)
        ids.append(list(rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered))
    return ids


def merge_lora(adapter: AdapterInfo, base: LLMCheckpoint, out: Path, options: LLMOptions, *, qlora: bool, dtype: str,
               steps: Steps, extra: dict | None = None) -> dict:
    """The adapter merged into its base (merge_and_unload), saved, reloaded and checked against base+adapter."""
    import torch
    import transformers
    from peft import PeftModel

    if qlora:
        log.warning("WARNING: %s was trained against a quantised (QLoRA) base; it is merged into the full-precision base "
                    "%s, so the merged model is close to, not exactly, what training saw. Evaluate it on your own "
                    "data before you deploy it (the parity below compares merged vs base+adapter, both in %s).",
                    adapter.path, base.path, dtype)
    torch_dtype = getattr(torch, dtype)
    tok_dir = adapter.path if any((adapter.path / n).is_file() for n in TOKENIZER_FILES) else base.path
    steps("loading base %s (%s) and adapter %s", base.path, dtype, adapter.path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(base.path, dtype=torch_dtype).eval()
        model = PeftModel.from_pretrained(model, adapter.path).eval()
    except Exception as exc:
        raise ExportError(f"cannot load base {base.path} with adapter {adapter.path} ({type(exc).__name__}: {exc})") from exc
    template = has_chat_template(tok_dir) or options.chat_template is not None
    sample_ids = _prompts(tokenizer, has_chat_template(tok_dir), options.sample_prompts or SAMPLE_PROMPTS)
    reference = first_outputs(model, sample_ids)
    with model.disable_adapter():
        effect = max(float(np.abs(r - b).max()) for r, b in zip(reference, first_outputs(model, sample_ids)))
    with _package(out) as pkg:
        steps("merging (merge_and_unload) and saving the standalone model")
        merged = model.merge_and_unload()
        merged.save_pretrained(pkg, safe_serialization=True)
        tokenizer.save_pretrained(pkg)
        _add_chat_template(pkg, options.chat_template)
        del model, merged
        steps("reloading the merged model from disk; comparing its logits with base+adapter on %d prompts", len(sample_ids))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(pkg, dtype=torch_dtype).eval()
        report = ParityReport(atol=DEFAULT_ATOL.get(dtype, 1e-3) if options.atol is None else options.atol)
        for ids, ref, got in zip(sample_ids, reference, first_outputs(reloaded, sample_ids)):
            report.add({"logits": ref}, {"logits": got})
        # What the adapter changes, beside what merging changed: a parity figure means little if the
        # adapter itself is a no-op.
        report.notes.append(f"the adapter itself moves the base's logits by up to {effect:.3g} (max abs)")
        report.check(options.allow_drift)
        parity = report.to_dict()
        (pkg / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
        metadata = {"kind": "merged", "source": str(adapter.path.resolve()), "base": str(base.path.resolve()),
                    "architecture": base.architecture, "dtype": dtype, "rank": adapter.rank,
                    "target_modules": list(adapter.targets), "qlora": qlora, "max_model_len": base.max_model_len,
                    "chat_template": template, "parity_passed": parity["passed"], "adapter_effect_max_abs": effect,
                    "command": options.command, **(extra or {})}
        _write_metadata(pkg, metadata)
    return {**metadata, "parity": parity}

def export_converted(layout: str, source: Path, out: Path, options: LLMOptions, extra: dict) -> dict:
    """A ZeRO or Megatron checkpoint -> a Hugging Face folder, checked against the trainer's own model, packaged."""
    import transformers

    steps = Steps(4, log)
    steps("checking the %s checkpoint %s", "DeepSpeed ZeRO" if layout == "zero" else "Megatron", source)
    trainer = _trainer_checkpoint(layout, source, Path(options.base).expanduser() if options.base else None)
    dtype = trainer.dtype if options.dtype == "auto" else options.dtype
    if dtype not in DEFAULT_ATOL:
        raise ExportError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DEFAULT_ATOL)}")
    atol = DEFAULT_ATOL[dtype] if options.atol is None else options.atol
    tokenizer = transformers.AutoTokenizer.from_pretrained(trainer.tokenizer_dir)
    ids = _prompts(tokenizer, has_chat_template(trainer.tokenizer_dir), options.sample_prompts or SAMPLE_PROMPTS)
    with repository.work_dir(out) as work:
        ckpt = trainer.ckpt
        if layout == "zero":
            hf, parity = zero.to_hugging_face(ckpt, trainer.config_dir, work, auto_class=CAUSAL_LM, ids=ids, dtype=dtype,
                                              atol=atol, allow_drift=options.allow_drift, steps=steps)
        else:
            hf = work / "hf"
            steps("merging TP=%d PP=%d shards with Megatron's dist_checkpointing, mapping them to %s with mbridge; "
                  "reference: the Megatron GPTModel loaded from the original shards", ckpt.tp, ckpt.pp,
                  megatron.ARCHITECTURES[ckpt.model_type][0])
            reference = megatron.convert(ckpt, trainer.tokenizer_dir, hf, ids, dtype)
            parity = compare_with_trainer(reference, hf, ids, auto_class=CAUSAL_LM, dtype=dtype, atol=atol,
                                          allow_drift=options.allow_drift, reference_command=options.command,
                                          reference_model=f"Megatron-core GPTModel (local spec) loaded from {ckpt.path}")
        _copy([f for f in _side_files(trainer.tokenizer_dir) if not (hf / f.name).exists()], hf)
        (work / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
        converted = inspect_llm(hf)
        if not converted.chat_template and options.chat_template is None:
            _warn_no_chat_template(source)
        metadata = package_full(converted, out, chat_template=options.chat_template, command=options.command,
                                steps=steps, extra={**extra, "source": str(source.resolve()),
                                                    "converted_from": trainer.origin, "parity_passed": parity["passed"]},
                                extra_files=(work / "parity.json",))
    return {**metadata, "parity": parity, "seconds": steps.seconds}


@dataclass
class _TrainerCheckpoint:
    """A ZeRO or Megatron checkpoint, read: where its config and tokenizer are, its dtype and where it came from."""

    ckpt: zero.ZeroCheckpoint | megatron.MegatronCheckpoint
    config_dir: Path | None
    tokenizer_dir: Path
    dtype: str
    origin: dict


def _trainer_checkpoint(layout: str, source: Path, base: Path | None) -> _TrainerCheckpoint:
    import transformers

    if layout == "zero":
        ckpt = zero.inspect_zero(source)
        config_dir = zero.config_folder(ckpt, base)
        dtype = str(transformers.AutoConfig.from_pretrained(config_dir).dtype or "float32").removeprefix("torch.")
        return _TrainerCheckpoint(ckpt, config_dir, zero.tokenizer_folder(config_dir, base), dtype, zero.origin(ckpt))
    ckpt = megatron.inspect_megatron(source)
    args = ckpt.args
    dtype = "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else "float32"
    origin = {"format": "megatron-torch_dist", "iteration": ckpt.iteration, "tensor_parallel": ckpt.tp,
              "pipeline_parallel": ckpt.pp, "converted_by": "megatron-core dist_checkpointing + mbridge"}
    return _TrainerCheckpoint(ckpt, None, megatron.tokenizer_folder(ckpt, base), dtype, origin)


@dataclass(frozen=True)
class LLMOptions:
    """How to export an LLM checkpoint: everything but the source and the output folder.

    base: an adapter's base (default: the local folder the adapter records); for a ZeRO or Megatron checkpoint
        without them, the folder with its config and tokenizer.
    merge: merge a LoRA adapter into its base (checked against base+adapter) instead of packaging it for vLLM.
    qlora: None detects it (LLaMA-Factory's training_args.yaml, quantization_bit 4 or 8); True / False say so.
    dtype: of a merge or conversion ("auto": the checkpoint's).
    atol: the logits' tolerated max abs difference (default per dtype, DEFAULT_ATOL).
    allow_drift: keep a merge or conversion that breaches `atol` (parity.json records it).
    sample_prompts: prompts for the parity check (default: a built-in set, plus the chat template's rendering).
    chat_template: a Jinja file to ship as the package's chat template.
    name: the served model name (default: the output folder's name).
    force: replace an existing output folder.
    command: the command line that reproduces this export, recorded in the metadata.
    quantize: a scheme (export/llm/quantize.py): the full-precision model made as above, then quantised.
    calibration, calibration_samples, eval_file, max_seq_length: the quantisation's data (export/llm/quantize.py).
    max_ppl_increase: the perplexity increase a quantisation may cost (relative); beyond it the export fails.
    """

    base: str | Path | None = None
    merge: bool = False
    qlora: bool | None = None
    dtype: str = "auto"
    atol: float | None = None
    allow_drift: bool = False
    sample_prompts: list[str] | None = None
    chat_template: Path | None = None
    name: str | None = None
    force: bool = False
    command: str = ""
    quantize: str | None = None
    calibration: Path | None = None
    calibration_samples: int | None = None
    eval_file: Path | None = None
    max_seq_length: int = 512
    max_ppl_increase: float = 0.05


def export_llm(source: str | Path, out: str | Path, options: LLMOptions = LLMOptions()) -> LLMExport:
    """Check and package a full fine-tune, package a LoRA adapter for vLLM, or merge it (`options.merge`).

    A DeepSpeed ZeRO or Megatron checkpoint is converted into a Hugging Face model first, and its logits are
    checked against the trainer's own model loaded from the original shards (parity.json).
    Raises ExportError (ParityError on a merge that drifted beyond `atol` without `allow_drift`).
    """
    source, out = _check_paths(Path(source).expanduser(), Path(out).expanduser(), options)
    if options.quantize:
        from .quantize import export_quantized

        return export_quantized(source, out, options)
    layout = runs.layout(source)
    trained = runs.describe(source)
    runs.check_finetuning_type(source, trained)
    extra = {"trained_with": trained} if trained else {}
    if layout in ("zero", "megatron"):
        if options.merge:
            raise ExportError(f"{source} is a {layout} checkpoint of a whole model; --merge applies to adapters")
        metadata = export_converted(layout, source, out, options, extra)
        serve = f"rtxserve serve vllm {out} --served-model-name {options.name or out.name}"
        return LLMExport("full", out, metadata, serve, metadata.pop("seconds"))
    if layout == "hf":
        return _export_full(source, out, options, extra)
    return _export_adapter(source, out, options, trained, extra)


def _check_paths(source: Path, out: Path, options: LLMOptions) -> tuple[Path, Path]:
    """Refuse a missing source, an output inside it, an existing output without force, a missing template."""
    if not source.exists():
        raise ExportError(f"not found: {source}")
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ExportError(f"--out {out} is inside the source {source}; choose a folder outside it")
    if out.exists() and not options.force:
        raise ExportError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if options.chat_template is not None and not Path(options.chat_template).is_file():
        raise ExportError(f"chat template not found: {options.chat_template}")
    return source, out


def _export_full(source: Path, out: Path, options: LLMOptions, extra: dict) -> LLMExport:
    """A full fine-tune in Hugging Face's layout: checked and packaged as it is."""
    if options.merge or options.base is not None:
        raise ExportError(f"{source} is a full model (no adapter_config.json); --merge and --base apply to adapters")
    steps = Steps(2, log)
    steps("checking %s", source)
    ckpt = inspect_llm(source, options.chat_template)
    if not ckpt.chat_template and options.chat_template is None:
        _warn_no_chat_template(source)
    metadata = package_full(ckpt, out, chat_template=options.chat_template, command=options.command, steps=steps,
                            extra=extra)
    serve = f"rtxserve serve vllm {out} --served-model-name {options.name or out.name}"
    if ckpt.vision:
        serve += " --max-images-per-prompt 4"
    return LLMExport("full", out, metadata, serve, steps.seconds)


def _export_adapter(source: Path, out: Path, options: LLMOptions, trained: dict | None, extra: dict) -> LLMExport:
    """A LoRA adapter: checked against its base, then packaged for vLLM or merged into the base."""
    steps = Steps(5 if options.merge else 3, log)
    steps("checking adapter %s", source)
    adapter = read_lora(source)
    ckpt = resolve_base(adapter, options.base)
    steps("checking every LoRA tensor against the layers of base %s", ckpt.path)
    check_lora_against_base(adapter, ckpt, for_vllm=not options.merge)
    qlora = runs.is_quantized_lora(trained) if options.qlora is None else options.qlora
    name = options.name or out.name
    if not options.merge:
        if qlora:
            log.warning("note: a QLoRA adapter served as a LoRA module runs on the full-precision base %s in vLLM, not "
                        "the quantised base it was trained against; evaluate it on your own data", ckpt.path)
        metadata = package_lora(adapter, ckpt, out, qlora=qlora, command=options.command, steps=steps, extra=extra)
        serve = f"rtxserve serve vllm {ckpt.path} --served-model-name {ckpt.path.name} --lora {name}={out}"
        return LLMExport("lora", out, metadata, serve, steps.seconds)
    dtype = ckpt.dtype if options.dtype == "auto" else options.dtype
    if dtype not in DEFAULT_ATOL:
        raise ExportError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DEFAULT_ATOL)}")
    if not (ckpt.chat_template or has_chat_template(source) or options.chat_template is not None):
        _warn_no_chat_template(ckpt.path)
    metadata = merge_lora(adapter, ckpt, out, options, qlora=qlora, dtype=dtype, steps=steps, extra=extra)
    return LLMExport("merged", out, metadata, f"rtxserve serve vllm {out} --served-model-name {name}", steps.seconds)

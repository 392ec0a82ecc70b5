"""The full-precision LLM packages (`rtxserve export llm` without --quantize), by what the source is:
- a full fine-tune (config.json + weights): checked (architecture, every weight file's integrity,
  tokenizer, chat template, dtype) and packaged;
- a LoRA / QLoRA adapter (adapter_config.json) packaged as a vLLM LoRA module: checked against its
  base (every LoRA tensor's shape against the base's layer, target modules vLLM can serve);
- the same adapter with `merge=True`: merged into its base (peft `merge_and_unload`) as a standalone
  model; the merged model, reloaded from disk, is compared with base+adapter on sample prompts and the
  figures are saved as parity.json. QLoRA adapters merge into the full-precision base with a warning;
- a DeepSpeed ZeRO or Megatron checkpoint: converted into a Hugging Face model (export/trainers/), its logits checked
  against the trainer's own model, and packaged as a full fine-tune.

Each package is made as package.py makes every one (built beside the output, renamed into place at the end).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.reference import FILE as REFERENCE_FILE, ReferenceError

from ..checkpoint import TOKENIZER_FILES
from ..exceptions import ExportError
from ..lora_adapter import AdapterInfo, read_lora
from ..parity import ParityReport, compare_with_trainer, first_outputs
from ..progress import Steps
from ..trainers import megatron, runs, zero
from ..triton import repository
from .checks import (LLMCheckpoint, chat_template_text, check_lora_against_base, has_chat_template, inspect_llm,
                     resolve_base, warn_no_chat_template)
from .options import LLMOptions
from .package import LLMExport, add_chat_template, copy_files, package_folder, side_files, write_metadata

log = logging.getLogger(__name__)

CAUSAL_LM = "AutoModelForCausalLM"

SAMPLE_PROMPTS = [
    "Hello, how can I help you today?",
    "Summarise the refund policy in one sentence.",
    "the quick brown fox",
    "Écris une phrase en français, s'il te plaît.",
    "1 2 3 4 5 6 7 8 9 10 " * 6,
]
# Default tolerance on logits, by the dtype the merged model is saved in: merging rounds W + BA to it.
DEFAULT_ATOL = {"float32": 1e-3, "float16": 0.25, "bfloat16": 0.25}


def package_full(source: LLMCheckpoint, out: Path, *, chat_template: Path | None, command: str,
                 steps: Steps, extra: dict | None = None, extra_files: tuple[Path, ...] = (),
                 reference: tuple[str, dict] | None = None) -> dict:
    steps("packaging %d weight file(s) and the tokenizer into %s", len(source.weights), out)
    with package_folder(out) as pkg:
        index = source.path / "model.safetensors.index.json"
        copy_files([*source.weights, *([index] if index.is_file() else []), source.path / "config.json",
               *side_files(source.path), *extra_files], pkg)
        add_chat_template(pkg, chat_template)
        metadata = {"kind": "full", "source": str(source.path.resolve()), "architecture": source.architecture,
                    "dtype": source.dtype, "max_model_len": source.max_model_len,
                    "chat_template": source.chat_template or chat_template is not None, "vision": source.vision,
                    "command": command, **(extra or {})}
        write_metadata(pkg, _with_reference(pkg, metadata, reference))
    return metadata


def package_lora(adapter: AdapterInfo, base: LLMCheckpoint, out: Path, *, qlora: bool, command: str,
                 steps: Steps, extra: dict | None = None, reference: tuple[str, dict] | None = None) -> dict:
    steps("packaging the adapter (rank %d, targets %s) as a vLLM LoRA module into %s",
          adapter.rank, ", ".join(adapter.targets), out)
    with package_folder(out) as pkg:
        copy_files([adapter.path / "adapter_config.json", adapter.weights, *side_files(adapter.path)], pkg)
        metadata = {"kind": "lora", "source": str(adapter.path.resolve()), "base": str(base.path.resolve()),
                    "base_architecture": base.architecture, "rank": adapter.rank, "lora_alpha": adapter.alpha,
                    "target_modules": list(adapter.targets), "qlora": qlora, "command": command, **(extra or {})}
        write_metadata(pkg, _with_reference(pkg, metadata, reference))
    return metadata


def _with_reference(pkg: Path, metadata: dict, reference: tuple[str, dict] | None) -> dict:
    """The reference set's file written into the package, and `metadata` naming it."""
    if reference is None:
        return metadata
    text, summary = reference
    (pkg / REFERENCE_FILE).write_text(text)
    return {**metadata, "reference": summary}


def framework_reference(model_dir: Path, tokenizer_dir: Path, options: LLMOptions, steps: Steps, *,
                        adapter: Path | None = None, model=None) -> tuple[str, dict] | None:
    """The reference set of a package (export/reference.py): the framework's greedy continuations of the eval set or
    the sample prompts, through the chat template the model was trained with (its own, else --chat-template), from
    the model in `model_dir` (with the adapter at `adapter`, through PEFT), or `model` already loaded."""
    import torch
    import transformers

    from .reference import llm_items, llm_reference

    if not options.reference:
        return None
    template = chat_template_text(tokenizer_dir) or (Path(options.chat_template).read_text() if options.chat_template
                                                      else None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    items = llm_items(tokenizer, template, options.sample_prompts or SAMPLE_PROMPTS, options.eval_set)
    steps("writing the reference set: transformers' greedy continuations of %d %s", len(items),
          "inputs of " + str(options.eval_set) if options.eval_set else "sample prompts")
    if model is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).eval()
    try:
        ref = llm_reference(model, tokenizer, template, items, source=(adapter or model_dir).resolve(),
                            made_from=str(options.eval_set) if options.eval_set else "probes", peft=adapter is not None)
        return ref.dump()
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


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
    framework = framework_reference(base.path, tok_dir, options, steps, adapter=adapter.path, model=model)
    reference = first_outputs(model, sample_ids)
    with model.disable_adapter():
        effect = max(float(np.abs(r - b).max()) for r, b in zip(reference, first_outputs(model, sample_ids)))
    with package_folder(out) as pkg:
        steps("merging (merge_and_unload) and saving the standalone model")
        merged = model.merge_and_unload()
        merged.save_pretrained(pkg, safe_serialization=True)
        tokenizer.save_pretrained(pkg)
        add_chat_template(pkg, options.chat_template)
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
        write_metadata(pkg, metadata := _with_reference(pkg, metadata, framework))
    return {**metadata, "parity": parity}


def export_converted(layout: str, source: Path, out: Path, options: LLMOptions, extra: dict) -> dict:
    """A ZeRO or Megatron checkpoint -> a Hugging Face folder, checked against the trainer's own model, packaged."""
    import transformers

    steps = Steps(4 + options.reference, log)
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
        copy_files([f for f in side_files(trainer.tokenizer_dir) if not (hf / f.name).exists()], hf)
        (work / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
        converted = inspect_llm(hf)
        if not converted.chat_template and options.chat_template is None:
            warn_no_chat_template(source)
        reference = framework_reference(hf, hf, options, steps)
        metadata = package_full(converted, out, chat_template=options.chat_template, command=options.command,
                                steps=steps, extra={**extra, "source": str(source.resolve()),
                                                    "converted_from": trainer.origin, "parity_passed": parity["passed"]},
                                extra_files=(work / "parity.json",), reference=reference)
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


def export_full_precision(source: Path, out: Path, options: LLMOptions) -> LLMExport:
    """Check and package a full fine-tune, package a LoRA adapter for vLLM, or merge it (`options.merge`); a DeepSpeed
    ZeRO or Megatron checkpoint is converted into a Hugging Face model first. `source` and `out` are checked already
    (export_llm); `options.quantize` is not read here.

    Raises ExportError (ParityError on a merge or conversion that drifted beyond `atol` without `allow_drift`).
    """
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


def _export_full(source: Path, out: Path, options: LLMOptions, extra: dict) -> LLMExport:
    """A full fine-tune in Hugging Face's layout: checked and packaged as it is."""
    if options.merge or options.base is not None:
        raise ExportError(f"{source} is a full model (no adapter_config.json); --merge and --base apply to adapters")
    steps = Steps(2 + options.reference, log)
    steps("checking %s", source)
    ckpt = inspect_llm(source, options.chat_template)
    if ckpt.vision and options.reference:
        log.info("note: no reference set for a vision-language model yet (its chat takes images); `rtxserve eval` "
                 "needs --eval-set for it")
        steps.total -= 1
    if not ckpt.chat_template and options.chat_template is None:
        warn_no_chat_template(source)
    reference = None if ckpt.vision else framework_reference(source, source, options, steps)
    metadata = package_full(ckpt, out, chat_template=options.chat_template, command=options.command, steps=steps,
                            extra=extra, reference=reference)
    serve = f"rtxserve serve vllm {out} --served-model-name {options.name or out.name}"
    if ckpt.vision:
        serve += " --max-images-per-prompt 4"
    return LLMExport("full", out, metadata, serve, steps.seconds)


def _export_adapter(source: Path, out: Path, options: LLMOptions, trained: dict | None, extra: dict) -> LLMExport:
    """A LoRA adapter: checked against its base, then packaged for vLLM or merged into the base."""
    steps = Steps((5 if options.merge else 3) + options.reference, log)
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
        tokenizer_dir = source if any((source / n).is_file() for n in TOKENIZER_FILES) else ckpt.path
        reference = framework_reference(ckpt.path, tokenizer_dir, options, steps, adapter=source)
        metadata = package_lora(adapter, ckpt, out, qlora=qlora, command=options.command, steps=steps, extra=extra,
                                reference=reference)
        serve = f"rtxserve serve vllm {ckpt.path} --served-model-name {ckpt.path.name} --lora {name}={out}"
        return LLMExport("lora", out, metadata, serve, steps.seconds)
    dtype = ckpt.dtype if options.dtype == "auto" else options.dtype
    if dtype not in DEFAULT_ATOL:
        raise ExportError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DEFAULT_ATOL)}")
    if not (ckpt.chat_template or has_chat_template(source) or options.chat_template is not None):
        warn_no_chat_template(ckpt.path)
    metadata = merge_lora(adapter, ckpt, out, options, qlora=qlora, dtype=dtype, steps=steps, extra=extra)
    return LLMExport("merged", out, metadata, f"rtxserve serve vllm {out} --served-model-name {name}", steps.seconds)

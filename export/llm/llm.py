"""`rtxserve export llm`: LLaMA-Factory (and plain Hugging Face) LLM outputs -> folders vLLM serves.

The entry of the LLM exports: the paths are checked, then the package is made in full precision (full_precision.py: a
full fine-tune, a LoRA adapter packaged or merged, a trainer's checkpoint converted) or, with `options.quantize`,
quantised from that full-precision model (quantize.py). Every package is built as package.py builds one.
"""

from __future__ import annotations

from pathlib import Path

from ..exceptions import ExportError
from .full_precision import export_full_precision
from .options import LLMOptions
from .package import LLMExport
from .quantize import export_quantized


def export_llm(source: str | Path, out: str | Path, options: LLMOptions = LLMOptions()) -> LLMExport:
    """Check and package a full fine-tune, package a LoRA adapter for vLLM, or merge it (`options.merge`); quantise
    the result with `options.quantize`.

    A DeepSpeed ZeRO or Megatron checkpoint is converted into a Hugging Face model first, and its logits are
    checked against the trainer's own model loaded from the original shards (parity.json).
    Raises ExportError (ParityError on a merge that drifted beyond `atol` without `allow_drift`).
    """
    source, out = _check_paths(Path(source).expanduser(), Path(out).expanduser(), options)
    if options.quantize:
        return export_quantized(source, out, options)
    return export_full_precision(source, out, options)


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

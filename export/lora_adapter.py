"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), read and checked before any weights
load, and the local base it was trained on: what the LLM, speech and encoder exports share of an adapter. How its
tensors fit the base's layers is core/lora.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core import lora

from .checkpoint import check_safetensors
from .exceptions import ExportError

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter folder, read: its config, rank, alpha, target modules, the base it records, its tensors' shapes."""

    path: Path
    config: dict
    rank: int
    alpha: float
    targets: tuple[str, ...]
    recorded_base: str
    weights: Path
    shapes: dict[str, list[int]]


def read_lora(path: Path) -> AdapterInfo:
    """The LoRA adapter in `path`; ExportError for a missing or malformed config, missing or pickled weights."""
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
    """ExportError naming the adapter, its base and the tensors that do not fit, if any do not."""
    if mismatch:
        raise ExportError(lora.misfit_message(adapter.path, adapter.recorded_base, base, mismatch) + " (--base)")


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

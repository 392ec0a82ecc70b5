"""The one check that a LoRA adapter fits its base, read by export (merge or package) and by serve (vLLM).

An adapter fits when every `*.lora_A` / `*.lora_B` tensor it holds fits the layer it adapts: A is
(rank, fan-in, ...), B is (fan-out, rank, ...). The layers come from the base's safetensors headers
(no weights are read and no torch is needed) for causal LMs, or from a weightless model for the encoder
tasks, whose heads and prefixes depend on the task class. A base whose recorded name differs from the
one given, but whose shapes fit, is accepted: the same model is often known by a hub name and a folder.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from safetensors import safe_open

from .contract import LORA_RANKS
from .json_files import read_object

log = logging.getLogger(__name__)

# peft's key for a LoRA tensor: [base_model.model.]<module>.lora_A|B[.<adapter name>].weight
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# Layers vLLM cannot serve LoRA on (merge such adapters into their base instead).
VLLM_UNSUPPORTED = frozenset({"lm_head", "embed_tokens"})


class AdapterConfigError(ValueError):
    """An adapter folder without a readable LoRA adapter_config.json."""


def read_adapter_config(folder: Path) -> dict:
    """A PEFT adapter's adapter_config.json, checked to be a JSON object of a LoRA (or QLoRA) adapter."""
    path = Path(folder) / "adapter_config.json"
    if not path.is_file():
        raise AdapterConfigError(f"{folder} has no adapter_config.json (expected a PEFT adapter folder)")
    try:
        config = read_object(path, "adapter")
    except ValueError as exc:
        raise AdapterConfigError(str(exc)) from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterConfigError(f"{folder} is a {config.get('peft_type')} adapter; only LoRA / QLoRA adapters are served")
    return config


def tensor_shapes(files: list[Path] | tuple[Path, ...]) -> dict[str, list[int]]:
    """Name -> shape of every tensor in these safetensors files, from their headers.

    Raises OSError or safetensors.SafetensorError for a file that is damaged or not safetensors."""
    shapes = {}
    for file in files:
        with safe_open(file, "np") as f:
            shapes |= {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    return shapes


def layers_from_weights(weights: dict[str, list[int]], config: dict) -> dict[str, tuple[int, int]]:
    """Module path -> (fan-in, fan-out) of every matrix (or convolution) in a checkpoint's weights.
    A head tied to the embeddings is not saved; it takes the embedding's shape."""
    layers = {k.removesuffix(".weight"): (s[1], s[0]) for k, s in weights.items()
              if k.endswith(".weight") and len(s) in (2, 4)}
    if config.get("tie_word_embeddings", True) and "lm_head" not in layers:
        embed = next((v for k, v in layers.items() if k.endswith("embed_tokens")), None)
        if embed:
            layers["lm_head"] = embed
    return layers


def misfits(adapter: dict[str, list[int]], layers: dict[str, tuple[int, int]]) -> tuple[list[str], set[str]]:
    """(what does not fit, the adapted layers' short names) for an adapter's tensor shapes against a base."""
    mismatch, adapted = [], set()
    for key, shape in adapter.items():
        match = LORA_KEY.match(key)
        if not match:
            continue
        module, ab = match["module"], match["ab"]
        adapted.add(module.rsplit(".", 1)[-1])
        if module not in layers:
            mismatch.append(f"{module} (no such layer in the base)")
            continue
        fan_in, fan_out = layers[module]
        expected = [shape[0], fan_in, *shape[2:]] if ab == "A" else [fan_out, *shape[1:]]
        if list(shape) != expected:
            mismatch.append(f"{key} has shape {shape}, the base needs {expected}")
    return mismatch, adapted


def misfit_message(adapter: Path, recorded_base: str, base: Path, mismatch: list[str]) -> str:
    return (f"adapter {adapter} does not fit base model {base} (the adapter records base {recorded_base or '(none)'}): "
            + "; ".join(mismatch[:3]) + (f" and {len(mismatch) - 3} more" if len(mismatch) > 3 else "")
            + "; use the base it was trained on")


def vllm_problems(adapted: set[str], adapter_config: dict) -> str | None:
    """Why vLLM cannot serve this adapter unmerged, or None."""
    rank = int(adapter_config.get("r", 8))
    if rank > LORA_RANKS[-1]:
        return f"LoRA rank {rank} is above vLLM's maximum {LORA_RANKS[-1]}"
    unsupported = sorted(adapted & VLLM_UNSUPPORTED) + list(adapter_config.get("modules_to_save") or [])
    if unsupported:
        return f"vLLM cannot serve LoRA on {', '.join(unsupported)} (target modules / modules_to_save)"
    return None


def same_base_name(recorded: str, base: Path) -> bool:
    recorded = recorded.rstrip("/")
    return not recorded or recorded in {str(base).rstrip("/"), str(base.resolve())} or Path(recorded).name == base.name


class AdapterFitError(ValueError):
    """An adapter that does not fit its base (`kind` "misfit"), holds no LoRA tensors ("empty") or that vLLM cannot
    serve unmerged ("vllm"); each side adds its own way out."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def check_fit(adapter: Path, adapter_config: dict, adapter_shapes: dict[str, list[int]], base: Path,
              base_shapes: dict[str, list[int]], base_config: dict, *, for_vllm: bool) -> None:
    """The one fit check, in its order: every LoRA tensor fits a layer of the base; there is at least one; vLLM
    can serve it unmerged (`for_vllm`); a base whose recorded name differs but whose shapes fit is only noted."""
    recorded = str(adapter_config.get("base_model_name_or_path") or "")
    mismatch, adapted = misfits(adapter_shapes, layers_from_weights(base_shapes, base_config))
    if mismatch:
        raise AdapterFitError(misfit_message(adapter, recorded, base, mismatch), "misfit")
    if not adapted:
        raise AdapterFitError(f"{adapter} holds no LoRA tensors (no *.lora_A/lora_B.weight)", "empty")
    problem = vllm_problems(adapted, adapter_config) if for_vllm else None
    if problem:
        raise AdapterFitError(problem, "vllm")
    if not same_base_name(recorded, base):
        log.warning("the adapter %s records base %s and goes on %s: its tensor shapes fit", adapter, recorded, base)

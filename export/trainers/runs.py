"""What the trainers write, recognised: LLaMA-Factory runs (training_args.yaml), Hugging Face Trainer
`checkpoint-N/` folders (trainer_state.json), DeepSpeed ZeRO shards and Megatron checkpoints.

`describe` reads what a run records about itself (for rtxserve.json and the checks in export/llm/);
`layout` says which converter, if any, a folder needs before it is a Hugging Face model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..checkpoint import find_weights, is_adapter
from ..exceptions import ExportError
from .megatron import is_megatron
from .zero import is_zero

LLAMAFACTORY_ARGS = ("training_args.yaml", "training_args.yml")
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def llamafactory_args(path: Path) -> dict | None:
    """LLaMA-Factory's training_args.yaml (LLaMA-Board writes it into the run's output folder, and a
    checkpoint-N folder inherits its parent's), or None."""
    import yaml

    for folder in (path, path.parent):
        for name in LLAMAFACTORY_ARGS:
            file = folder / name
            if file.is_file():
                try:
                    args = yaml.safe_load(file.read_text())
                except yaml.YAMLError as exc:
                    raise ExportError(f"{file} is not valid YAML ({exc})") from exc
                if not isinstance(args, dict):
                    raise ExportError(f"{file} does not hold a mapping of training arguments")
                return {**args, "_file": str(file)}
    return None


def describe(path: Path) -> dict:
    """What the run records about itself: trainer, template, finetuning type, quantisation, step."""
    info: dict = {}
    args = llamafactory_args(path)
    if args is not None:
        info.update(trainer="llama-factory", training_args=args["_file"],
                    **{k: args[k] for k in ("stage", "finetuning_type", "template", "quantization_bit",
                                            "model_name_or_path", "deepspeed") if args.get(k) is not None})
    state = path / "trainer_state.json"
    if state.is_file():
        try:
            step = json.loads(state.read_text()).get("global_step")
        except (OSError, json.JSONDecodeError):
            step = None
        info.setdefault("trainer", "transformers")
        if step is not None:
            info["global_step"] = step
    return info


def check_finetuning_type(path: Path, info: dict) -> None:
    """LLaMA-Factory's finetuning_type against what the folder holds: a LoRA run without an adapter is a mistake."""
    kind = info.get("finetuning_type")
    if kind == "lora" and not is_adapter(path):
        raise ExportError(f"{info['training_args']} says finetuning_type: lora, but {path} holds no adapter_config.json; "
                          "pass the run's output folder (or one of its checkpoint-N folders)")
    if kind in ("full", "freeze") and is_adapter(path):
        raise ExportError(f"{info['training_args']} says finetuning_type: {kind}, but {path} holds a LoRA adapter")


def is_quantized_lora(info: dict) -> bool:
    return str(info.get("quantization_bit", "")) in ("4", "8")


def layout(path: Path) -> str:
    """'adapter', 'hf' (config + weights), 'zero' or 'megatron'; ExportError for a run folder with nothing to export."""
    if is_adapter(path):
        return "adapter"
    if (path / "config.json").is_file() and find_weights(path) is not None:
        return "hf"
    if is_zero(path):
        return "zero"
    if is_megatron(path):
        return "megatron"
    checkpoints = sorted((p for p in path.iterdir() if p.is_dir() and CHECKPOINT_DIR.match(p.name)),
                         key=lambda p: int(CHECKPOINT_DIR.match(p.name).group(1))) if path.is_dir() else []
    if checkpoints:
        raise ExportError(f"{path} holds no model of its own, only the Trainer checkpoints "
                          f"{', '.join(p.name for p in checkpoints)}; pass one of them (e.g. {checkpoints[-1]})")
    return "hf"  # inspect_llm says what is missing

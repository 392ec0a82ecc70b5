"""PEFT LoRA adapters on encoder tasks: checked against their base, then merged for export.

An adapter folder (`adapter_config.json` + `adapter_model.safetensors`) on a supported encoder task is
resolved to its local base and checked before any weights load: the adapter's task type against the
task, every LoRA tensor against the base's layer it adapts, and every saved head tensor
(`modules_to_save`, e.g. a classifier trained with the adapter) against the base's head. The export is
then made from the merged model (peft `merge_and_unload`) and validated against the unmerged PeftModel.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from core import lora

from ..checkpoint import (IMAGE_PROCESSOR_FILE, TOKENIZER_FILES, WEIGHT_FILES, check_safetensors, find_weights,
                          is_adapter, read_json)
from ..exceptions import ExportError
from ..lora_adapter import AdapterInfo, base_folder, raise_misfit, read_lora
from .task_specs import ENCODER_TASKS, Checkpoint, check_task, label_names

log = logging.getLogger(__name__)

# peft saves a modules_to_save copy as `<module>.<param>`; older versions kept the wrapper's path.
_SAVED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class EncoderAdapter:
    checkpoint: Checkpoint  # path: where the tokenizer / image processor is; weights: the adapter's
    adapter: AdapterInfo
    base_path: Path


def _check_task_type(adapter: AdapterInfo, task: str) -> None:
    # the peft task_type an adapter for the task records (an adapter may also record none)
    recorded, wanted = adapter.config.get("task_type"), ENCODER_TASKS[task].peft_task_type
    if recorded is None or recorded == wanted:
        return
    matching = [t.name for t in ENCODER_TASKS.values() if t.peft_task_type == recorded]
    hint = f"; export it with --task {matching[0]}" if matching else ""
    raise ExportError(f"adapter {adapter.path} was trained with task_type {recorded}, which does not fit task {task} "
                      f"(that needs task_type {wanted or 'none'}){hint}")


def _base_folder(adapter: AdapterInfo, base: str | Path | None) -> Path:
    path = Path(base_folder(adapter, base)).expanduser()
    if not path.is_dir():
        raise ExportError(f"base model not found: {path}" if not path.exists() else f"base {path} is not a directory")
    if is_adapter(path) and not (path / "config.json").is_file():
        raise ExportError(f"base {path} is itself an adapter; pass the full model it was trained on with --base")
    if not (path / "config.json").is_file():
        raise ExportError(f"base {path} is not a Hugging Face checkpoint: no config.json")
    weights = find_weights(path)
    if weights is None:
        raise ExportError(f"no model weights in base {path}: expected one of {', '.join(WEIGHT_FILES)}")
    if weights.suffix == ".safetensors":
        check_safetensors(weights)
    return path


def _meta_model(auto_class, config, num_labels: int | None):
    """(architecture, parameter name -> shape, adapted-layer path -> (fan-in, fan-out)) of a weightless model."""
    import torch

    if num_labels is not None:
        config = copy.deepcopy(config)
        config.num_labels = num_labels
    with torch.device("meta"):
        model = auto_class.from_config(config)
    params = {name: list(p.shape) for name, p in model.named_parameters()}
    layers = lora.layers_from_weights(params, {"tie_word_embeddings": False})
    return type(model).__name__, params, layers


def _labels(adapter_dir: Path, base_config: dict, count: int) -> list[str]:
    """Label names: the adapter folder's config.json, else the base's when the count matches, else LABEL_i."""
    own = adapter_dir / "config.json"
    for config in ([read_json(own, "adapter's config")] if own.is_file() else []) + [base_config]:
        id2label = config.get("id2label") or {}
        if len(id2label) == count:
            return label_names(id2label, count)
    return [f"LABEL_{i}" for i in range(count)]


def _check_fit(adapter: AdapterInfo, base: Path, arch: str, params: dict, layers: dict, head: dict) -> None:
    """Every LoRA tensor against the layer it adapts, every saved head tensor against the base's parameter."""
    mismatch, _ = lora.misfits(adapter.shapes, layers)
    mismatch = [m.replace("in the base)", f"in the base's {arch})") for m in mismatch]
    for name, (key, shape) in head.items():
        if name not in params:
            mismatch.append(f"{key} (no such parameter in the base's {arch})")
        elif list(shape) != params[name]:
            mismatch.append(f"{key} has shape {shape}, the base needs {params[name]}")
    raise_misfit(adapter, base, mismatch)


def _processor_folder(adapter_dir: Path, base: Path, task: str) -> Path:
    """The folder whose tokenizer (image processor for image tasks) the export uses: the adapter's, else the base's."""
    image = ENCODER_TASKS[task].image
    files = (IMAGE_PROCESSOR_FILE,) if image else TOKENIZER_FILES
    source = next((d for d in (adapter_dir, base) if any((d / f).is_file() for f in files)), None)
    if source is None:
        raise ExportError(f"no {'image processor' if image else 'tokenizer'} in adapter {adapter_dir} nor in its "
                          f"base {base}: expected one of {', '.join(files)}")
    return source


def _head_tensors(adapter: AdapterInfo) -> dict[str, tuple[str, list[int]]]:
    """The adapter's saved head tensors (modules_to_save), by the base's parameter name: (its key, its shape). An
    adapter without a single LoRA tensor is refused."""
    head = {}
    for key, shape in adapter.shapes.items():
        if ".lora_" not in key and "trainable_tokens" not in key:
            # (lora_embedding_A/B, DoRA magnitudes and trainable-token deltas are left to peft's own load)
            name = _SAVED_COPY.sub(".", key.removeprefix(_PREFIX))
            head[name] = (key, shape)
    if not any(lora.LORA_KEY.match(key) for key in adapter.shapes):
        raise ExportError(f"{adapter.weights} holds no LoRA tensors (no *.lora_A/lora_B.weight)")
    return head


def _num_labels(adapter: AdapterInfo, head: dict, label_dims: dict, base_labels: int, base_config: dict,
                base_path: Path, task: str) -> int:
    """The label count of the merged model: the saved head's (its tensors must agree), else the base's, which must
    then have a trained head of the task (a *ForX architecture), not one that would load random."""
    counts = {head[n][1][d] for n, d in label_dims.items() if n in head and len(head[n][1]) > d}
    if len(counts) > 1:
        raise ExportError(f"the head tensors saved in {adapter.weights} disagree on the number of labels "
                          f"({sorted(counts)})")
    if label_dims and not any(n in head for n in label_dims):
        suffix = ENCODER_TASKS[task].arch_suffix
        if not any(isinstance(a, str) and a.endswith(suffix) for a in base_config.get("architectures") or []):
            raise ExportError(f"adapter {adapter.path} saves no {task} head and base {base_path} is not a "
                              f"*{suffix} model, so the head would be random; train the adapter with "
                              "modules_to_save=['classifier'] (or the head's name), or pass the fine-tuned base "
                              "with --base")
    return counts.pop() if counts else base_labels


def resolve_adapter(path: str | Path, task: str, base: str | Path | None = None) -> EncoderAdapter:
    """Check a LoRA adapter folder for `task` against its base; no weights are loaded.

    Args:
        path: the folder written by the PeftModel's `save_pretrained` (adapter_config.json + safetensors).
        task: one of ENCODER_TASKS (task_specs.py).
        base: the base model folder; default: the adapter's recorded `base_model_name_or_path`, which
            must then be a local folder.

    Returns:
        the adapter, its base, and a Checkpoint describing the merged model (architecture, label names
        of the adapter's head, the folder holding the tokenizer or image processor).

    Raises:
        ExportError: not a safetensors LoRA adapter, a task type that does not fit `task`, no usable
            base, or a tensor that does not fit the base (the message names adapter, base and tensors).
    """
    import transformers

    check_task(task)
    path = Path(path).expanduser()
    if not is_adapter(path):
        raise ExportError(f"{path} is not a PEFT adapter folder: no adapter_config.json")
    adapter = read_lora(path)
    _check_task_type(adapter, task)
    base_path = _base_folder(adapter, base)
    base_config = read_json(base_path / "config.json", "base checkpoint")
    auto_name = ENCODER_TASKS[task].auto_class
    auto_class = getattr(transformers, auto_name)
    try:
        config = transformers.AutoConfig.from_pretrained(base_path)
        base_labels = config.num_labels
        arch, params, layers = _meta_model(auto_class, config, None)
        # Which parameters depend on the label count, and along which dimension: a head the adapter
        # trained for its own labels sets the count.
        _, params_plus, _ = _meta_model(auto_class, config, base_labels + 1)
    except Exception as exc:
        raise ExportError(f"base {base_path} (model_type {base_config.get('model_type')}) cannot be built as "
                          f"{auto_name} for task {task} ({type(exc).__name__}: {exc})") from exc
    label_dims = {n: next(i for i, (a, b) in enumerate(zip(s, params_plus[n])) if a != b)
                  for n, s in params.items() if s != params_plus.get(n, s)}

    head = _head_tensors(adapter)
    num_labels = _num_labels(adapter, head, label_dims, base_labels, base_config, base_path, task)
    if num_labels != base_labels:
        arch, params, layers = _meta_model(auto_class, config, num_labels)

    _check_fit(adapter, base_path, arch, params, layers, head)
    recorded = adapter.recorded_base.rstrip("/")
    if base is not None and recorded and Path(recorded).name != base_path.name:
        log.warning("note: the adapter records base %s, merged with %s; its tensor shapes fit", recorded, base_path)

    source = _processor_folder(path, base_path, task)
    merged_config = {**base_config, "architectures": [arch]}
    if label_dims:
        labels = _labels(path, base_config, num_labels)
        merged_config |= {"num_labels": num_labels, "id2label": {str(i): l for i, l in enumerate(labels)},
                          "label2id": {l: i for i, l in enumerate(labels)}}
    checkpoint = Checkpoint(path=source, task=task, config=merged_config, architecture=arch, weights=adapter.weights)
    return EncoderAdapter(checkpoint=checkpoint, adapter=adapter, base_path=base_path)


def load_models(adapter: EncoderAdapter, auto_class):
    """The merged model to export and the unmerged PeftModel to validate it against (both float32, eval).

    Args:
        adapter: from `resolve_adapter`.
        auto_class: the transformers Auto class of the task (or its name), e.g. AutoModelForSequenceClassification.

    Returns:
        (merged, reference): `merge_and_unload()` of base + adapter (a plain transformers model), and
        base + adapter as a PeftModel (`reference.disable_adapter()` gives the bare base's outputs).

    Raises:
        ExportError: the base or the adapter failed to load.
    """
    import transformers
    from peft import PeftModel

    if isinstance(auto_class, str):
        auto_class = getattr(transformers, auto_class)
    ckpt = adapter.checkpoint
    try:
        config = transformers.AutoConfig.from_pretrained(adapter.base_path)
        resized = False
        if "id2label" in ckpt.config:
            resized = len(ckpt.config["id2label"]) != config.num_labels
            config.id2label = {int(i): l for i, l in ckpt.config["id2label"].items()}
            config.label2id = dict(ckpt.config["label2id"])
        # Eager attention, as export/encoders/encoder.py loads checkpoints. A head resized to the adapter's
        # label count is initialised randomly here and replaced by the adapter's saved head.
        base = auto_class.from_pretrained(adapter.base_path, config=config, dtype="float32",
                                          attn_implementation="eager", ignore_mismatched_sizes=resized).eval()
        reference = PeftModel.from_pretrained(copy.deepcopy(base), adapter.adapter.path).eval()
        merged = PeftModel.from_pretrained(base, adapter.adapter.path).merge_and_unload().eval()
    except Exception as exc:
        raise ExportError(f"cannot load base {adapter.base_path} with adapter {adapter.adapter.path} "
                          f"({type(exc).__name__}: {exc})") from exc
    return merged, reference

"""Inspect a fine-tuned checkpoint directory before any heavy work, with errors a user can act on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core import tasks as registry
from core.json_files import read_object

from .exceptions import ExportError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json", "spiece.model", "sentencepiece.bpe.model")

# encoder task -> (architecture suffix it needs, transformers Auto class that loads it), from the registry
TASKS = {name: (t.arch_suffix, t.auto_class) for name, t in registry.TASKS.items() if t.kind == "encoder"}
IMAGE_TASKS = tuple(name for name in TASKS if registry.TASKS[name].inputs == "image")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    task: str
    config: dict
    architecture: str
    weights: Path

    @property
    def labels(self) -> list[str]:
        """Label names in class-index order (`id2label`), or LABEL_i when the checkpoint has none."""
        id2label = self.config.get("id2label") or {}
        return label_names(id2label, len(id2label) or int(self.config.get("num_labels", 2)))


def label_names(id2label: dict, count: int) -> list[str]:
    """`count` label names from an `id2label` map (string or int keys), LABEL_i where it has none."""
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is a PEFT adapter folder (it holds adapter_config.json)."""
    return (Path(path).expanduser() / "adapter_config.json").is_file()


def find_weights(path: Path) -> Path | None:
    """The checkpoint's weights file (or shard index), if any."""
    return next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; ExportError naming the file when it is unreadable or not an object."""
    try:
        return read_object(path, what)
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ExportError(f"unsupported task {task!r}; supported tasks: {', '.join(sorted(TASKS))}")
    return task


def inspect_checkpoint(path: str | Path, task: str) -> Checkpoint:
    """Check that `path` is a Hugging Face checkpoint for `task` (no weights are loaded here)."""
    check_task(task)
    path = Path(path).expanduser()
    if not path.exists():
        raise ExportError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ExportError(f"{path} is not a directory; pass the folder written by save_pretrained()")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ExportError(
            f"{path} is not a Hugging Face checkpoint: no config.json (pass the folder written by save_pretrained())"
        )
    config = read_json(config_path, "checkpoint")
    weights = find_weights(path)
    if weights is None:
        raise ExportError(f"no model weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")
    if task in IMAGE_TASKS:
        if not (path / IMAGE_PROCESSOR_FILE).is_file():
            raise ExportError(f"no {IMAGE_PROCESSOR_FILE} in {path}: {task} needs the image processor beside the "
                              "model (image_processor.save_pretrained)")
    elif not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(f"no tokenizer in {path}: save the tokenizer beside the model (tokenizer.save_pretrained)")
    suffix = TASKS[task][0]
    architectures = config.get("architectures") or []
    matching = [a for a in architectures if isinstance(a, str) and a.endswith(suffix)]
    if not matching:
        found = ", ".join(map(str, architectures)) or "none recorded"
        raise ExportError(
            f"task {task} needs a *{suffix} model, but {config_path} names architectures: {found}"
        )
    return Checkpoint(path=path, task=task, config=config, architecture=matching[0], weights=weights)


def check_safetensors(path: str | Path) -> dict[str, list[int]]:
    """Read a .safetensors header without loading tensors: tensor name -> shape.

    Raises ExportError naming the file when the header is unreadable or the file is shorter than
    the header says (a truncated download or copy)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ExportError(f"{path} is truncated or not a safetensors file ({len(head)} bytes)")
            size = int.from_bytes(head, "little")
            if size > 100_000_000:
                raise ExportError(f"{path} is not a safetensors file (header length {size} is implausible)")
            header = json.loads(f.read(size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} has an unreadable safetensors header ({exc}); the file is damaged") from exc
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    actual = path.stat().st_size - 8 - size
    if actual < end:
        raise ExportError(f"{path} is truncated: its header describes {end} bytes of tensors, the file holds {actual}; "
                          "copy or download it again")
    return {k: v["shape"] for k, v in tensors.items()}

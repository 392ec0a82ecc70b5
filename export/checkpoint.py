"""The files of a fine-tuned checkpoint folder (weights, tokenizer, image processor, JSON configs, safetensors headers),
checked before any heavy work, with errors a user can act on: what every export reads. Which checkpoint a task needs
is its family's (export/encoders/task_specs.py, export/llm/checks.py, export/speech/whisper.py)."""

from __future__ import annotations

import json
from pathlib import Path

from core.json_files import read_object

from .exceptions import ExportError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json", "spiece.model", "sentencepiece.bpe.model")


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

"""Where a Hugging Face folder keeps its safetensors weights: one file, or the shards its index lists. Declared
once for export (LLMs, diffusion components), serve (the adapter check against a served model) and deploy."""

from __future__ import annotations

import json
from pathlib import Path


class WeightsIndexError(ValueError):
    """An index file that is not the JSON `save_pretrained` writes."""


def safetensors_files(folder: Path, name: str = "model.safetensors") -> list[Path]:
    """`folder/name` if it is there, else the shards `folder/name.index.json` lists (present or not: the caller
    says what a missing shard means), else none."""
    folder = Path(folder)
    if (folder / name).is_file():
        return [folder / name]
    index = folder / f"{name}.index.json"
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, ValueError, AttributeError) as exc:
        raise WeightsIndexError(f"{index} is not a weights index ({exc})") from None
    return [folder / shard for shard in sorted(set(weight_map.values()))]

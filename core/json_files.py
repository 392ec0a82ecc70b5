"""Reading the JSON files checkpoints and adapters carry: one object per file, or an error naming the file."""

from __future__ import annotations

import json
from pathlib import Path


def read_object(path: Path, what: str) -> dict:
    """The JSON object in `path`; ValueError naming the file (and `what` it belongs to) when it is unreadable,
    not JSON, or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); the {what} is damaged") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object; the {what} is damaged")
    return data

"""`rtxserve.json` of a Triton entry, typed: what `rtxserve export` writes beside an entry's config and what
deploy, serve and the planner read. One schema for both sides; fields that only some tasks record are
optional, and whatever else an export records (versions, parity figures, adapters) is kept as it is.

Entries written before this schema still load. Their one ambiguous field, `dimensions`, held the model's
dimension table (a mapping) for most tasks but the embedding size (a number) for embedders; the reader moves
it to `model_dimensions` or `embedding_size` and says so in `assumed`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FILE = "rtxserve.json"


class EntryMetadataError(ValueError):
    """An rtxserve.json that cannot be read: one line naming the file and the field."""


class EntryMetadata(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    task: str
    target: Literal["cpu", "gpu"] = "cpu"
    source: str | None = None
    architecture: str | None = None
    # the model's sizes (hidden_size, num_hidden_layers, ...), what the planner sizes activations from
    model_dimensions: dict[str, int] = Field(default_factory=dict)
    # an image graph's live tensors at its largest input (export/activations.py): per_item_bytes, fixed_bytes,
    # item_shape; None where onnx-tool could not follow the graph
    graph_activations: dict[str, Any] | None = None
    # an embedder's output size (after pooling)
    embedding_size: int | None = Field(default=None, ge=1)
    instances: int | None = Field(default=None, ge=1)
    max_batch_size: int | None = Field(default=None, ge=0)
    max_length: int | None = Field(default=None, ge=1)
    precision: str | None = None
    command: str = ""
    # diffusion entries: the UNet's native resolution, the export's default size, the VAE's scale factor
    native_size: int | None = Field(default=None, ge=8)
    default_size: int | None = Field(default=None, ge=8)
    vae_scale: int | None = Field(default=None, ge=1)
    # the reference set beside the entry (core/reference.py): file, items, made_from, sha256
    reference: dict[str, Any] | None = None
    # what a reader assumed about an entry written before this schema (not written back)
    assumed: list[str] = Field(default_factory=list, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "dimensions" not in data:
            return data
        data = dict(data)
        old = data.pop("dimensions")
        notes = list(data.get("assumed") or [])
        if isinstance(old, dict):
            data.setdefault("model_dimensions", old)
            notes.append("'dimensions' (written before the schema) read as the model's dimensions")
        elif isinstance(old, int) and not isinstance(old, bool):
            data.setdefault("embedding_size", old)
            notes.append("'dimensions' (written before the schema) read as the embedding size")
        elif old is not None:
            raise ValueError(f"'dimensions' is neither the model's dimensions nor an embedding size: {old!r}")
        data["assumed"] = notes
        return data

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude_none=True) + "\n"

    @classmethod
    def parse(cls, data: dict, where: str = FILE) -> "EntryMetadata":
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(the whole file)"
            raise EntryMetadataError(f"{where}: {field}: {first['msg'].removeprefix('Value error, ')}") from None

    @classmethod
    def read(cls, path: str | Path) -> "EntryMetadata":
        """The rtxserve.json at `path` (the file, or the entry folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise EntryMetadataError(f"{path}: cannot be read ({exc.strerror})") from None
        except ValueError as exc:
            raise EntryMetadataError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise EntryMetadataError(f"{path}: not a JSON object")
        return cls.parse(data, str(path))


def entry_metadata_json(metadata: dict) -> str:
    """What export writes: `metadata` checked against the schema (a field of the wrong type is a bug here)."""
    return EntryMetadata.model_validate(metadata).to_json()

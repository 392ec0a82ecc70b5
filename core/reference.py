"""The reference set that travels with an exported model: inputs, and what the training framework itself answered on
them. `rtxserve export` writes it beside the artifact (a Triton entry's folder, an LLM or Whisper package, an adapter
package) and names it in the entry's rtxserve.json; `rtxserve eval` sends the same inputs through a served box and
compares. One schema for both sides, declared here, on the ground floor.

What an item holds, by task (`input`, then `expect`, the framework's answer):
- text-classification: a text; {"label", "logits"} (image-classification: {"image": base64} as input)
- token-classification: a text; {"entities": [{entity, score, start, end, word}, ...]} as transformers' pipeline
- feature-extraction: a text; {"embedding": [...]}
- object-detection: {"image": base64}; {"detections": [[x1, y1, x2, y2, score, class_id], ...]}
- text-generation: {"messages": [...]} (chat) or {"prompt": "..."}; {"token_ids", "text", "top_logprobs"}: the greedy
  continuation, and per position the framework's top log-probabilities as [[token id, logprob], ...]
- automatic-speech-recognition: {"audio": base64, "filename"}; {"text"}
- text-to-image: {"prompt", "seed", "steps", "size"}; {"image": base64 PNG}
`gold` (optional, from the user's --eval-set) is the right answer: a label, entities, a text.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FILE = "reference.json"
SCHEMA_VERSION = 1
# A reference set travels with the model; it is a handful of probes, not a test set. Export refuses a bigger one.
MAX_BYTES = 8 * 2**20
MAX_ITEMS = 256


class ReferenceError(ValueError):
    """A reference set that cannot be read or written: one line naming the file and what is wrong."""


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: Any = Field(description="what is sent: a text, or an object (image, audio, prompt, messages)")
    expect: dict[str, Any] = Field(default_factory=dict, description="the framework's own answer on it")
    gold: Any = Field(None, description="the right answer, where the user's eval set gave one")


class ReferenceSet(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    schema_version: int = SCHEMA_VERSION
    task: str
    framework: str = Field(description="what answered: the library and its version (transformers 5.23.0, ...)")
    source: str = Field("", description="the checkpoint the framework loaded")
    made_from: str = Field("probes", description="probes (export's own inputs) or the user's eval set file")
    labels: list[str] | None = Field(None, description="class names in id order, where the task has labels")
    tokenizer: str | None = Field(None, description="sha256 of the serving tokenizer (tokenizer.json), where any")
    variant: str = Field("fp32", description="the precision / form of the served artifact (fp32, int8, fp16, ...)")
    drift: dict[str, float] = Field(default_factory=dict, description="what export measured between the served "
                                    "artifact and the framework on these inputs (max_abs_diff, min_cosine, ...)")
    settings: dict[str, Any] = Field(default_factory=dict, description="how the inputs are sent (aggregation, "
                                     "max_tokens, logprobs, api, ...)")
    items: list[Item] = Field(min_length=1, max_length=MAX_ITEMS)

    def dump(self) -> tuple[str, dict]:
        """(the file's text, what rtxserve.json names it by: file, items, made_from, sha256); ReferenceError when it
        is over its bound."""
        text = self.model_dump_json(indent=1, exclude_none=True) + "\n"
        size = len(text.encode())
        if size > MAX_BYTES:
            raise ReferenceError(f"the reference set is {size / 2**20:.1f} MiB, over its {MAX_BYTES // 2**20} MiB "
                                 f"bound: give fewer or smaller inputs (it has {len(self.items)})")
        return text, {"file": FILE, "items": len(self.items), "made_from": self.made_from,
                      "sha256": fingerprint(text)}

    def write(self, folder: Path) -> dict:
        """Write FILE into `folder`; returns what rtxserve.json names it by."""
        text, summary = self.dump()
        (Path(folder) / FILE).write_text(text)
        return summary

    @classmethod
    def read(cls, path: str | Path) -> "ReferenceSet":
        """The reference set at `path` (the file, or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ReferenceError(f"{path}: no reference set (models exported before reference sets have none: "
                                 "export again, or give --eval-set)") from None
        except OSError as exc:
            raise ReferenceError(f"{path}: cannot be read ({exc.strerror})") from None
        if len(raw) > MAX_BYTES:
            raise ReferenceError(f"{path}: {len(raw)} bytes, over the {MAX_BYTES} a reference set may hold")
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ReferenceError(f"{path}: not JSON ({exc})") from None
        try:
            ref = cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(the whole file)"
            raise ReferenceError(f"{path}: {where}: {first['msg']}") from None
        if ref.schema_version > SCHEMA_VERSION:
            raise ReferenceError(f"{path}: schema version {ref.schema_version} is newer than this rtxserve reads "
                                 f"({SCHEMA_VERSION}); upgrade rtxserve")
        return ref


def fingerprint(text: str | bytes) -> str:
    """sha256 of a tokenizer's serialised form (tokenizer.json), as reference sets record it."""
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


# The user's eval set (--eval-set FILE): JSON lines, one input each, with its right answer where known. Files
# (images, audio) are named relative to the eval set's folder. What each task reads from a line, and its gold:
EVAL_SET_FIELDS = {
    "text-classification": ("text", "label"),
    "token-classification": ("text", "entities"),
    "feature-extraction": ("text", None),
    "image-classification": ("image", "label"),
    "object-detection": ("image", "detections"),
    "text-generation": ("messages|prompt", "answer"),
    "automatic-speech-recognition": ("audio", "text"),
    "text-to-image": ("prompt", None),
}
FILE_FIELDS = ("image", "audio")


def read_eval_set(path: str | Path, task: str) -> list[Item]:
    """The items of an eval set file for `task` (inputs, and gold where a line gives it; no framework answers yet).
    ReferenceError naming the file and line for anything it cannot read."""
    import base64

    path = Path(path)
    if task not in EVAL_SET_FIELDS:
        raise ReferenceError(f"eval sets are not read for {task} models")
    field, gold_field = EVAL_SET_FIELDS[task]
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReferenceError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ReferenceError(f"{where}: not JSON ({exc})") from None
        if isinstance(row, str) and field == "text":
            row = {"text": row}
        if not isinstance(row, dict):
            raise ReferenceError(f"{where}: expected an object with {field.replace('|', ' or ')!r}")
        names = field.split("|")
        present = [n for n in names if n in row]
        if len(present) != 1:
            raise ReferenceError(f"{where}: give exactly one of {', '.join(repr(n) for n in names)} (a {task} eval set)")
        name = present[0]
        value = row[name]
        if name in FILE_FIELDS:
            file = (path.parent / str(value)).resolve()
            try:
                data = file.read_bytes()
            except OSError as exc:
                raise ReferenceError(f"{where}: {name} {value!r}: cannot be read ({exc.strerror})") from None
            value = {name: base64.b64encode(data).decode(), "filename": file.name}
        elif name == "text":
            if not isinstance(value, str) or not value:
                raise ReferenceError(f"{where}: 'text' must be a non-empty string")
        elif name in ("messages", "prompt") and task == "text-generation":
            value = {name: value}
        elif task == "text-to-image":
            value = {"prompt": value, **{k: row[k] for k in ("seed", "steps", "size") if k in row}}
        unknown = set(row) - {name, gold_field, *(("seed", "steps", "size") if task == "text-to-image" else ())}
        if unknown:
            raise ReferenceError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        items.append(Item(input=value, gold=row.get(gold_field) if gold_field else None))
    if not items:
        raise ReferenceError(f"{path}: no inputs (JSON lines, one input each)")
    if len(items) > MAX_ITEMS:
        raise ReferenceError(f"{path}: {len(items)} inputs; a reference set holds at most {MAX_ITEMS}")
    return items

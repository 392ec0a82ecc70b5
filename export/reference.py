"""What every export's reference set is made with (core/reference.py): the inputs (the user's `--eval-set`, or the
probes the export already checks with) and the versions of what answered. Each family makes its own set beside its
export, from the checkpoint as trained (an adapter through PEFT, unmerged), not from the exported artifact:
export/encoders/reference.py, export/llm/reference.py, and the detection, speech and diffusion exports. `rtxserve
eval` sends the same inputs through a served box and compares its answers with these.
"""

from __future__ import annotations

from pathlib import Path

from core.reference import Item, ReferenceError, read_eval_set

from .exceptions import ExportError


def eval_items(eval_set: Path | None, task: str) -> list[Item] | None:
    """The user's eval set as items (inputs and gold, no answers yet), or None for the export's own probes."""
    if eval_set is None:
        return None
    try:
        return read_eval_set(eval_set, task)
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


def versions(*names: str) -> str:
    """What answered, as a reference set records it: "transformers 5.23.0, peft 0.21.2"."""
    import importlib.metadata

    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


def export_drift(parity: dict) -> dict[str, float]:
    """What export measured between the served variant and the framework, over its outputs: the worst of each."""
    outputs = list(parity.get("outputs", {}).values())
    if not outputs:
        return {}
    return {"max_abs_diff": max(o["max_abs_diff"] for o in outputs), "min_cosine": min(o["min_cosine"] for o in outputs),
            "top1_agreement": min(o["top1_agreement"] for o in outputs)}

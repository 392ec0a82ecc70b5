"""Small fine-tuned-style checkpoints, built on this machine (no model hub), for the tests, the demo and the
benchmarks: one module per family. A trained fixture is trained until it answers the probes its tests read with a
margin, or its build stops and says what it did not learn (training.py), since what a number of steps learns differs
from one CPU to the next.
"""

from __future__ import annotations

from pathlib import Path

from .detection import write_detector, write_yolo
from .llm import write_llm_with_adapters
from .speech import write_whisper
from .text import write_ner_tagger, write_reranker, write_text_classifier
from .vision import write_image_classifier

FIXTURES = {"text-classifier": write_text_classifier, "ner-tagger": write_ner_tagger,
            "image-classifier": write_image_classifier, "detector": write_detector, "yolo": write_yolo,
            "llm": write_llm_with_adapters, "whisper": write_whisper, "reranker": write_reranker}


def write_fixtures(folder: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """Write the named fixtures (default: all) into `folder`/<name>; returns name -> path."""
    unknown = set(names or []) - set(FIXTURES)
    if unknown:
        raise ValueError(f"unknown fixture(s) {sorted(unknown)}; valid: {', '.join(FIXTURES)}")
    folder = Path(folder)
    return {name: FIXTURES[name](folder / name) for name in (names or list(FIXTURES))}

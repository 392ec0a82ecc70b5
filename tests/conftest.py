"""Tiers by folder: tests/unit (in-process), tests/integration (real servers), tests/gpu (CUDA only).

The marker of each tier is applied here, so `pytest -m unit` etc. select by tier; gpu tests are
skipped where no NVIDIA GPU is visible.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "gpu")


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def pytest_collection_modifyitems(config, items):
    gpu = None
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if "gpu" in parts:
            gpu = _has_gpu() if gpu is None else gpu
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


@pytest.fixture(scope="session")
def classifier_checkpoint(tmp_path_factory) -> Path:
    """The fixture BERT classifier (trained briefly so that its labels mean something)."""
    from export.fixtures import write_text_classifier

    return write_text_classifier(tmp_path_factory.mktemp("ckpt") / "text-classifier")


@pytest.fixture(scope="session")
def ner_checkpoint(tmp_path_factory) -> Path:
    """The fixture BERT NER tagger (BIO tags for PER / LOC / ORG; names split into sub-words)."""
    from export.fixtures import write_ner_tagger

    return write_ner_tagger(tmp_path_factory.mktemp("ckpt") / "ner-tagger")

"""The modules rtxserve starts in other processes by name or by path are where it says: a room moved in export/ once
left torchrun's ranks unable to import export.trainers.zero_reference (its PYTHONPATH pointed one folder too deep)."""

import importlib.util

from export.detection import yolo
from export.llm import quantize
from export.trainers import zero


def test_torchruns_ranks_find_the_zero_reference_module_from_the_path_they_are_given():
    spec = importlib.util.find_spec("export.trainers.zero_reference")
    assert spec is not None and spec.origin == str(zero.SOURCE_ROOT / "export" / "trainers" / "zero_reference.py")


def test_the_runners_started_by_path_exist():
    assert yolo.RUNNER.is_file() and quantize.RUNNER.is_file()

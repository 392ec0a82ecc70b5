"""Write model folders into a Triton repository so that a failed export leaves nothing behind.

Everything is built in a work folder beside the repository (same file system) and renamed into
place only at the end; the work folder is removed whatever happens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..exceptions import ExportError
from .entry import ModelDir

log = logging.getLogger(__name__)


def check_free(repository: Path, names: list[str], force: bool) -> None:
    """Fail before any work if the entry exists and may not be replaced."""
    if repository.exists() and not repository.is_dir():
        raise ExportError(f"model repository {repository} is not a directory")
    taken = [n for n in names if (repository / n).exists()]
    if taken and not force:
        raise ExportError(
            f"{', '.join(taken)} already exist(s) in {repository}; pass --force to replace, or choose another --name"
        )


@contextlib.contextmanager
def work_dir(repository: Path) -> Iterator[Path]:
    """A scratch folder on the repository's file system, removed on exit (success or not)."""
    parent = repository.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".rtxserve-export-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _write_model_dir(root: Path, model: ModelDir) -> None:
    folder = root / model.config.name
    (folder / "1").mkdir(parents=True)  # every model, ensembles included, needs a version folder
    (folder / "config.pbtxt").write_text(model.config.to_pbtxt())
    for rel, source in model.files.items():
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            shutil.copy2(source, target)
        else:
            target.write_text(source)


def commit(repository: Path, models: list[ModelDir], work: Path, force: bool) -> list[Path]:
    """Stage `models` under `work`, then move them into `repository` (replacing only with force)."""
    names = [m.config.name for m in models]
    check_free(repository, names, force)
    stage = work / "stage"
    stage.mkdir()
    for model in models:
        _write_model_dir(stage, model)
    repository.mkdir(parents=True, exist_ok=True)
    retired = work / "retired"
    retired.mkdir()
    written = []
    for name in names:
        target = repository / name
        if target.exists():
            os.replace(target, retired / name)
        os.replace(stage / name, target)
        written.append(target)
    log.info("wrote %s into %s", ", ".join(names), repository)
    return written

"""What the gateway changed at run time, kept where every worker and the next start find it: one JSON file, replaced
atomically, read-modify-written under a file lock (the `filelock` library), reread by each worker when it changes."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...settings import Alias

log = logging.getLogger("rtxserve.gateway.rollout")
T = TypeVar("T")
# Before the switch a promotion can be undone by restoring the route it found; from the switch on, the candidate
# serves everything and finishing it is all that is left.
ACTIVE = ("started", "shadow", "canary", "switched")
Phase = Literal["started", "shadow", "canary", "switched", "done", "rolled_back"]
HISTORY = 20  # ended promotions kept, newest last


class Promotion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    model: str = Field(description="the name clients call")
    current: str = Field(description="the model serving it when the promotion began")
    candidate: str
    phase: Phase = "started"
    weight: int = Field(0, ge=0, le=100, description="the candidate's share of the requests, percent")
    shadow: float = Field(0.0, ge=0.0, le=1.0, description="the share of the current model's requests copied to the "
                          "candidate (shadow phase)")
    before: Alias | None = Field(None, description="the route the promotion found (None: the model itself)")
    started: float
    updated: float
    lease_until: float = Field(description="rolled back (before the switch) or finished (after) when not renewed by then")
    boot: str = Field("", description="the gateway's start (all its workers) it began under: a start of the gateway "
                      "ends it, a worker that starts beside running ones leaves it be")
    reason: str = Field("", description="why it ended as it did")

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE


class Snapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    routes: dict[str, Alias] = Field(default_factory=dict, description="names routed by promotions: they override "
                                     "settings.aliases of the same name, and may name the model of the same name")
    retired: list[str] = Field(default_factory=list, description="models a finished promotion replaced (unloaded "
                               "where their backend can; never served by their own name again while routed)")
    promotions: dict[str, Promotion] = Field(default_factory=dict, description="the promotion of each name, while it runs")
    history: list[Promotion] = Field(default_factory=list)

    def end(self, promotion: Promotion, phase: Phase, reason: str) -> Promotion:
        """Move `promotion` to the history as `phase`, for `reason`."""
        ended = promotion.model_copy(update={"phase": phase, "reason": reason, "updated": time.time()})
        self.promotions.pop(promotion.model, None)
        self.history = [*self.history, ended][-HISTORY:]
        return ended


class RolloutError(RuntimeError):
    """The rollout file cannot be read or written."""


class RolloutStore:
    """The snapshot, in memory, and in `path` where one is set (without one: this process only, gone at its end)."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self._lock = FileLock(str(self.path) + ".lock", timeout=10) if self.path else None
        self._memory = Snapshot()
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) of the file last read: each write
        # replaces the file, so a new inode says it changed whatever the clock's resolution

    def changed(self) -> bool:
        """Whether the file changed since it was last read here (another worker wrote it)."""
        return self.path is not None and self._stat() != self._seen

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def read(self) -> Snapshot:
        if self.path is None:
            return self._memory.model_copy(deep=True)
        seen = self._stat()
        if seen is None:
            self._seen = None
            return Snapshot()
        try:
            snapshot = Snapshot.model_validate_json(self.path.read_bytes())
        except (OSError, ValidationError) as exc:
            why = (f"{'.'.join(map(str, exc.errors()[0]['loc'])) or 'the file'}: {exc.errors()[0]['msg']}"
                   if isinstance(exc, ValidationError) else exc.strerror)
            raise RolloutError(f"the rollout file {self.path} cannot be read ({why}); move it aside to start from the "
                               "deployment's own routes") from None
        self._seen = seen
        return snapshot

    def update(self, change: Callable[[Snapshot], T]) -> tuple[T, Snapshot]:
        """`change(snapshot)` on the newest snapshot, under the lock, then written: (what it returned, the snapshot)."""
        with self._locked():
            snapshot = self.read()
            result = change(snapshot)
            self._write(snapshot)
            return result, snapshot

    @contextlib.contextmanager
    def _locked(self):
        if self._lock is None:
            yield
            return
        try:
            with self._lock:
                yield
        except Timeout:
            raise RolloutError(f"the rollout file {self.path} stayed locked for 10 s") from None

    def _write(self, snapshot: Snapshot) -> None:
        if self.path is None:
            self._memory = snapshot.model_copy(deep=True)
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(snapshot.model_dump_json(indent=1) + "\n")
        os.replace(tmp, self.path)
        self._seen = self._stat()

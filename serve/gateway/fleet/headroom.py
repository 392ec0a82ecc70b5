"""Live headroom: how close today's traffic runs to what the box was shown to hold.

`rtxserve capacity --record` finds a model's capacity (the most requests/s it holds within an SLO, confirmed at 0.9x
and 1.1x) and sends it here (PUT /admin/capacity/{model}); the gateway keeps it in `capacity_file` with the box it was
measured on (`fingerprint`: the models the gateway serves and where, with their engines' limits, and the settings that
shape their capacity). Every second each worker counts its requests per model over the last HEADROOM_WINDOW_S seconds
and exports their rate over the capacity (metric_names.CAPACITY_USED, by model and stale, summed over the workers),
beside the capacity itself; `stale` is "true" where the box changed since the figure was measured (another model
added, an engine with other limits), which then is flagged, never silently trusted. The other workers read the file
when it changes.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import time
from pathlib import Path

from .. import metrics

HEADROOM_WINDOW_S = 10
TICK_S = 1.0


def fingerprint(settings, models) -> str:
    """The box as its capacity depends on it: each served model's task, backend and limits, where the backends are,
    and the settings that gate the requests (`models`: the registry's ModelInfo values)."""
    shape = {"models": sorted([m.name, m.task, m.backend, m.max_batch_size, m.extra.get("max_model_len")]
                              for m in models),
             "backends": [settings.triton_grpc_url, settings.vllm_url], "workers": settings.workers,
             "gates": [settings.max_concurrency, settings.model_concurrency]}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Headroom:
    def __init__(self, settings, registry):
        self.settings, self.registry = settings, registry
        self.path: Path | None = settings.capacity_file
        self.records: dict[str, dict] = {}
        self._mtime = None
        self._counts: collections.deque = collections.deque(maxlen=HEADROOM_WINDOW_S + 1)
        self._shown: dict[str, str] = {}  # model -> the `stale` label its series carry
        self.used: dict[str, float] = {}

    def box(self) -> str:
        return fingerprint(self.settings, self.registry.models.values())

    def record(self, model: str, rps: float, slo: str, how: str) -> dict:
        """Keep `model`'s confirmed capacity, stamped with this box and the time; written to the file (all of them, as
        read last) so that every worker and the next start see it."""
        self._read()
        self.records[model] = {"requests_per_second": rps, "slo": slo, "how": how, "measured_at": time.time(),
                               "box": self.box()}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(self.records, indent=2))
            partial.replace(self.path)
        self.tick()
        return self.status()[model]

    def _read(self) -> None:
        if self.path is None:
            return
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime != self._mtime:
                self.records, self._mtime = json.loads(self.path.read_text()), mtime
        except (OSError, ValueError):  # none recorded yet, or a file being replaced: the last one read stands
            pass

    def status(self) -> dict[str, dict]:
        """Per recorded model: its capacity, how it was measured, whether the box changed since, the share used now."""
        box = self.box()
        return {model: r | {"stale": r.get("box") != box, "used_ratio": self.used.get(model)}
                for model, r in sorted(self.records.items())}

    def tick(self, now: float | None = None) -> None:
        """Read the file if it changed, take this second's counts, and set the gauges."""
        self._read()
        self._counts.append((time.monotonic() if now is None else now, collections.Counter(metrics.SEEN)))
        (t0, first), (t1, last) = self._counts[0], self._counts[-1]
        seconds = t1 - t0
        box = self.box() if self.records else ""  # nothing recorded (most boxes): nothing to fingerprint
        for model, r in self.records.items():
            rps = (last[model] - first[model]) / seconds if seconds > 0 else 0.0
            stale = "true" if r.get("box") != box else "false"
            if self._shown.get(model, stale) != stale:  # the other label's series would keep its last value (and a
                # series cannot be removed across workers): zeroed
                metrics.CAPACITY_USED.labels(model, self._shown[model]).set(0)
                metrics.CAPACITY_RPS.labels(model, self._shown[model]).set(0)
            self._shown[model] = stale
            capacity = float(r["requests_per_second"])
            self.used[model] = rps / capacity if capacity > 0 else float("inf")
            metrics.CAPACITY_RPS.labels(model, stale).set(capacity)
            metrics.CAPACITY_USED.labels(model, stale).set(self.used[model])

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(TICK_S)

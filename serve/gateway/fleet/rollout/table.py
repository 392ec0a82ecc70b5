"""Each worker's live view of the rollout file (store.py), read on every request, and the promotion's steps.

A promotion of a name clients call (`model`) from the model serving it (`current`) to a `candidate`:
  started   nothing changes for clients; the candidate is loaded and checked (`rtxserve promote`'s eval gate)
  shadow    a share of the current model's requests is sent again to the candidate, its answers compared and dropped
  canary    the name's route sends `weight` percent of its requests to the candidate
  switched  the candidate takes every new request; the current model answers what it has in flight and stays loaded
            for a rollback
  done      the current model is retired (unloaded where its backend can), the route stays on the candidate
  rolled_back  the route the promotion found is back, from any step before done
While it runs, the promotion holds a lease its driver renews; one not renewed in time is rolled back (before the switch)
or finished (after it), and a gateway that starts finds every promotion in one of those two states. A start is the
gateway's, all its workers (BOOT): a worker that starts beside running ones, late or after a crash, leaves the
promotions of its own gateway's start running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable

from ...settings import Alias, GatewaySettings
from .store import Promotion, RolloutStore, Snapshot

log = logging.getLogger("rtxserve.gateway.rollout")
# This start of the gateway: `rtxserve serve gateway` gives every worker it starts the same (a gateway run otherwise,
# one per process).
BOOT = os.environ.get("RTXSERVE_GATEWAY_BOOT") or secrets.token_hex(8)
# How a step moves the route, from the promotion's fields.
FORWARD = {"started": ("started", "shadow", "canary", "switched"), "shadow": ("shadow", "canary", "switched"),
           "canary": ("canary", "switched"), "switched": ("switched",)}


class PromotionConflict(ValueError):
    """A step the promotion's state does not allow (another promotion runs, an ended one, a step backwards)."""


class PromotionNotFound(PromotionConflict):
    """No promotion of that name (of that id) runs, nor ever ran."""


class Rollout:
    def __init__(self, settings: GatewaySettings, retire: Callable[[str], Awaitable[str]] | None = None):
        self.settings = settings
        self.store = RolloutStore(settings.rollout_file)
        self.retire = retire  # unloads a replaced model where its backend can; says what it did
        self._apply(Snapshot())

    # ------------------------------------------------------------------------------------------- what requests read

    def _apply(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.routes: dict[str, Alias] = {**self.settings.aliases, **snapshot.routes}
        active = [p for p in snapshot.promotions.values() if p.active]
        self.watching = {m: p.model for p in active for m in (p.current, p.candidate)}
        self.shadows = {p.current: (p.candidate, p.shadow, p.model) for p in active if p.phase == "shadow" and p.shadow}
        self.retired = frozenset(snapshot.retired)
        # never unloaded to make room or when idle: what a promotion is moving between, and what it put in front
        self.pinned = frozenset({m for p in active for m in (p.current, p.candidate)}
                                | {t for r in snapshot.routes.values() for t in r.targets})

    def serves(self, name: str) -> bool:
        """Whether `name` is a route (an alias, or a name a promotion moved to another model)."""
        return name in self.routes

    # ------------------------------------------------------------------------------------------- keeping it current

    async def start(self) -> None:
        """At the gateway's start: a promotion found before its switch is rolled back, one found switched is finished
        (the box serves the old model or the new one, never a mix)."""
        def recover(s: Snapshot) -> list[Promotion]:
            found = [p for p in s.promotions.values() if p.boot != BOOT]
            for p in found:
                if p.phase != "switched":
                    _restore(s, p)
                    s.end(p, "rolled_back", f"interrupted: the gateway restarted during its {p.phase} step")
            return [p for p in found if p.phase == "switched"]

        switched, snapshot = self.store.update(recover)
        self._apply(snapshot)
        for p in switched:
            try:
                await self.finish(p.model, p.id, "the gateway restarted after its switch: finished")
            except PromotionConflict:  # another worker, starting beside this one, finished it: follow its file now,
                self._apply(self.store.read())  # not at the next refresh, a second after this worker calls itself ready

    async def run_loop(self) -> None:
        """`refresh` every second: another worker's step is followed within one, an expired lease ended."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.refresh()
            except Exception:  # the loop must survive a damaged file or a backend that fails a retirement
                log.exception("rollout refresh failed")

    async def refresh(self) -> None:
        """Reread the file if another worker changed it, and end the promotions whose lease ran out (the health loop
        calls this every interval)."""
        if self.store.changed():
            self._apply(self.store.read())
        now = time.time()
        for p in [p for p in self.snapshot.promotions.values() if p.lease_until < now]:
            why = f"its driver stopped renewing its lease during its {p.phase} step"
            with contextlib.suppress(PromotionConflict):  # another worker saw it first, or its driver renewed it
                if p.phase == "switched":
                    await self.finish(p.model, p.id, why + ": finished", expired=True)
                else:
                    self.rollback(p.model, p.id, why, expired=True)

    # ------------------------------------------------------------------------------------------- the steps

    def begin(self, model: str, current: str, candidate: str, lease_s: float) -> Promotion:
        """A new promotion of `model` from `current` to `candidate`; PromotionConflict while another runs."""
        def begin(s: Snapshot) -> Promotion:
            running = s.promotions.get(model)
            if running is not None:
                raise PromotionConflict(f"a promotion of {model} is running ({running.id}: {running.current} -> "
                                        f"{running.candidate}, {running.phase}); wait for it, or roll it back")
            now = time.time()
            p = Promotion(id="p-" + secrets.token_hex(6), model=model, current=current, candidate=candidate,
                          before=s.routes.get(model), started=now, updated=now, lease_until=now + lease_s, boot=BOOT)
            s.promotions[model] = p
            return p

        promotion, snapshot = self.store.update(begin)
        self._apply(snapshot)
        log.info("promotion %s of %s: %s -> %s started", promotion.id, model, current, candidate)
        return promotion

    def step(self, model: str, promotion_id: str, *, phase: str, weight: int, shadow: float,
             lease_s: float) -> Promotion:
        """Move a running promotion on (or renew its lease: the same step again): its route follows."""
        def step(s: Snapshot) -> Promotion:
            p = _running(s, model, promotion_id)
            if phase not in FORWARD[p.phase]:
                raise PromotionConflict(f"{p.id} is at its {p.phase} step; it cannot go to {phase}")
            now = time.time()
            p = p.model_copy(update={"phase": phase, "weight": 100 if phase == "switched" else weight if phase == "canary"
                                     else 0, "shadow": shadow if phase == "shadow" else 0.0, "updated": now,
                                     "lease_until": now + lease_s})
            s.promotions[model] = p
            if phase in ("canary", "switched"):
                s.routes[model] = Alias(targets={t: w for t, w in ((p.current, 100 - p.weight),
                                                                   (p.candidate, p.weight)) if w})
            else:
                _restore(s, p)
            return p

        promotion, snapshot = self.store.update(step)
        self._apply(snapshot)
        return promotion

    def rollback(self, model: str, promotion_id: str | None, reason: str, expired: bool = False) -> Promotion:
        """Back to the route the promotion found, from any step before done (`expired`: only if its lease, as the
        file has it now, ran out)."""
        def rollback(s: Snapshot) -> Promotion:
            p = _running(s, model, promotion_id, expired)
            _restore(s, p)
            return s.end(p, "rolled_back", reason)

        promotion, snapshot = self.store.update(rollback)
        self._apply(snapshot)
        log.warning("promotion %s of %s rolled back: %s", promotion.id, model, reason)
        return promotion

    async def finish(self, model: str, promotion_id: str, reason: str = "finished", expired: bool = False) -> Promotion:
        """A switched promotion made final: the current model retired (unloaded where its backend can)."""
        def finish(s: Snapshot) -> Promotion:
            p = _running(s, model, promotion_id, expired)
            if p.phase != "switched":
                raise PromotionConflict(f"{p.id} is at its {p.phase} step; only a switched promotion finishes")
            s.routes[model] = Alias(targets={p.candidate: 100})
            if p.current != p.candidate and p.current not in s.retired:
                s.retired.append(p.current)
            s.retired = [m for m in s.retired if m != p.candidate]
            return s.end(p, "done", reason)

        promotion, snapshot = self.store.update(finish)
        self._apply(snapshot)
        retired = await self.retire(promotion.current) if self.retire is not None else "left loaded"
        log.info("promotion %s of %s done: %s serves it; %s %s", promotion.id, model, promotion.candidate,
                 promotion.current, retired)
        promotion, snapshot = self.store.update(lambda s: _note(s, promotion.id, f"{reason}; {promotion.current} "
                                                                                 f"{retired}"))
        self._apply(snapshot)
        return promotion


def _running(s: Snapshot, model: str, promotion_id: str | None, expired: bool = False) -> Promotion:
    """The promotion of `model` running now (of that id); with `expired`, only if its lease has run out."""
    p = s.promotions.get(model)
    if expired and p is not None and p.lease_until >= time.time():
        raise PromotionConflict(f"{p.id}'s lease was renewed")
    if p is None or (promotion_id is not None and p.id != promotion_id):
        ended = next((h for h in reversed(s.history) if h.id == promotion_id), None)
        if ended is not None:
            raise PromotionConflict(f"{promotion_id} has ended: {ended.phase.replace('_', ' ')} ({ended.reason})")
        raise PromotionNotFound(f"no promotion {promotion_id or ''} of {model} is running".replace("  ", " "))
    return p


def _restore(s: Snapshot, p: Promotion) -> None:
    """The route `p` found, back: an earlier promotion's, or none (then the settings' alias, or the model itself)."""
    if p.before is not None:
        s.routes[p.model] = p.before
    else:
        s.routes.pop(p.model, None)


def _note(s: Snapshot, promotion_id: str, reason: str) -> Promotion:
    for i, h in enumerate(s.history):
        if h.id == promotion_id:
            s.history[i] = h.model_copy(update={"reason": reason})
            return s.history[i]
    raise PromotionConflict(f"{promotion_id} is not in the history")

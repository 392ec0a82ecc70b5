"""One decider for the on-demand models of several gateways (a box's workers, a fleet's pods).

A gateway alone decides for itself (residency.py). Several deciding each for itself loaded a model twice, over-committed
the room, and one's idle timer unloaded what another streamed from. Here they share a database (serve/gateway/shared:
SQLite for one box's workers, PostgreSQL for a fleet) and one of them decides for all:
- **the decider** holds a lease in the database, renewed every BEAT_S; a decider that stops renewing (its process or
  pod died) is replaced by another gateway once its lease is `residency_lease_s` old; one that stops cleanly hands
  over at once. Only the decider loads and unloads.
  Every decision is written in the transaction that checks (and locks) the decider's lease: a decider that lost its
  lease writes nothing more, stops what it had under way, and two never write side by side. Leases compare the
  gateways' own clocks (kept by NTP across hosts).
- **every gateway beats** every BEAT_S, the decider included: it reads the decisions (each model's state, with an
  epoch that grows with every decision), then writes its row: the models its requests wait for (`wanted`), those a
  promotion retired through it (`retired`), its requests in flight and last use per model, and the newest epoch it
  has read (`seen`). A gateway whose row is `residency_lease_s` old is taken for dead, so a gateway whose own beats
  have failed that long starts no request on an on-demand model (the decider may unload it under them) until its
  beats succeed again.
- **a request** for a model the decisions do not say is loaded (and its replicas serve) waits, up to `load_wait_s`,
  for the decider to load it; then 503 with Retry-After while the load goes on. A load that failed answers 503 until
  its backoff ends, as residency.py does.
- **the decider** loads what any gateway wants, making room from the least recently used models that no live
  gateway runs a request on; it unloads a model idle for its `idle_unload_s` on every gateway, and one a promotion
  retired (through any gateway) once nothing runs on it and nobody asks for it.
- **an unload is announced first**: the model's state becomes `unloading` with a new epoch; a gateway that has read it
  starts no request on the model (they wait as for a model not loaded). The decider unloads only once every live
  gateway has read it and has nothing in flight on it: a stream is never cut. An idle unload is called off when a
  gateway still runs a request on the model or wants it; one that makes room waits for the model's requests to end.
- **a decider that dies mid-way** leaves a model `loading` or `unloading`: the next decider loads it again where a
  gateway wants it (a load finishes what is half-loaded) and otherwise announces and finishes the unload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Coroutine
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from .. import metrics
from ..exceptions import BackendUnavailable, GatewayError
from ..settings import GatewaySettings
from ..shared.db import engine_for, insert_for
from ..shared.migrations import upgrade
from .registry import Registry
from .residency import Residency

log = logging.getLogger("rtxserve.gateway.decider")
BEAT_S = 0.5
WAIT_S = 0.1  # how often a waiting request looks at the decisions this gateway last read
LEASE = "residency"
LOADED, UNLOADED, LOADING, UNLOADING, FAILED = "loaded", "unloaded", "loading", "unloading", "failed"

metadata = sa.MetaData()  # as migrations/versions/0003_residency.py makes them
decisions = sa.Table("residency", metadata, sa.Column("model", sa.Text, primary_key=True), sa.Column("state", sa.Text),
                     sa.Column("epoch", sa.BigInteger), sa.Column("changed_at", sa.Float), sa.Column("why", sa.Text),
                     sa.Column("retry_at", sa.Float))
gateways = sa.Table("gateways", metadata, sa.Column("name", sa.Text, primary_key=True), sa.Column("beat_at", sa.Float),
                    sa.Column("seen", sa.BigInteger), sa.Column("in_flight", sa.JSON), sa.Column("last_used", sa.JSON),
                    sa.Column("wanted", sa.JSON), sa.Column("retired", sa.JSON))
leases = sa.Table("leases", metadata, sa.Column("name", sa.Text, primary_key=True), sa.Column("holder", sa.Text),
                  sa.Column("until", sa.Float))


class LostLease(Exception):
    """This gateway no longer holds the decider's lease: what it was doing is another's now."""


class Decider(Residency):
    def __init__(self, settings: GatewaySettings, registry: Registry, url: str, password: str | None = None,
                 pinned: Callable[[], frozenset[str]] = lambda: frozenset()):
        super().__init__(settings, registry, pinned)
        self.engine = engine_for(url, password)
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"  # this gateway, in the rows
        self.decisions: dict[str, dict] = {}  # each model's decision, as this gateway last read it
        self._until = 0.0  # this gateway decides until then (time.monotonic), its lease as last renewed
        self._beat_ok = float("-inf")  # when this gateway's row was last written (time.monotonic)
        self._retired: set[str] = set()  # what a promotion retired through this gateway, until it is unloaded
        self._live: list[dict] = []  # every live gateway's row, as the decider last read them
        self._work: dict[str, asyncio.Task] = {}  # the decider's loads and unloads under way, by model
        self._draining: set[str] = set()
        self._schema = False
        self._wake: asyncio.Event | None = None
        self._refreshed = 0.0

    @property
    def deciding(self) -> bool:
        return time.monotonic() < self._until

    @property
    def beating(self) -> bool:
        """This gateway's row is fresh: the decider counts its requests (else it may take it for dead)."""
        return time.monotonic() - self._beat_ok < self.settings.residency_lease_s

    def loaded(self, name: str) -> bool:
        """The decider says it is loaded, this gateway's registry sees a replica serve it, and the decider counts this
        gateway's requests on it."""
        return super().loaded(name) and self.decisions.get(name, {}).get("state") == LOADED and self.beating

    # ------------------------------------------------------------------------------------------- requests

    async def ensure(self, name: str) -> None:
        """Return once `name` is loaded: ask the decider for it and wait, up to load_wait_s."""
        if name not in self.models or self.loaded(name):
            return
        self._refuse_if_failed(name)
        self._retired.discard(name)  # asked for again
        deadline = time.monotonic() + self.settings.load_wait_s
        with self._waiting(name):  # what the beat says this gateway wants
            if self._wake is not None:
                self._wake.set()  # beat now: the decider hears of it sooner
            await self._wait(name, deadline)
        metrics.LOAD_WAITS.labels(name, "served").inc()

    async def _wait(self, name: str, deadline: float) -> None:
        while not self.loaded(name):
            self._refuse_if_failed(name)
            decision = self.decisions.get(name, {})
            if decision.get("state") == LOADED and not self.serving(name) and \
                    time.monotonic() - self._refreshed >= BEAT_S:  # loaded; this gateway's registry has not seen it yet
                self._refreshed = time.monotonic()
                await self.registry.refresh()
                continue
            if time.monotonic() >= deadline:
                metrics.LOAD_WAITS.labels(name, "timeout").inc()
                why = decision.get("why") if decision.get("state") in (LOADING, UNLOADED) else None
                if not self.beating:
                    why = "waits for the residency store, which this gateway cannot reach"
                why = why or f"is still loading after {self.settings.load_wait_s:g} s"
                raise BackendUnavailable(f"model {name!r} {why}; retry shortly", retry_after=self.settings.load_wait_s)
            await asyncio.sleep(WAIT_S)

    def _failed_now(self, name: str) -> float:
        """Seconds until the next try of a model whose last load failed; 0 if it may be tried now."""
        decision = self.decisions.get(name, {})
        return max(0.0, (decision.get("retry_at") or 0) - time.time()) if decision.get("state") == FAILED else 0.0

    def _refuse_if_failed(self, name: str) -> None:
        left = self._failed_now(name)
        if left:
            metrics.LOAD_WAITS.labels(name, "failed").inc()
            raise BackendUnavailable(f"model {name!r} could not be loaded ({self.decisions[name].get('why')}); the next "
                                     f"try is in {left:.1f} s", retry_after=left)

    async def unload(self, name: str, reason: str) -> str:
        """`name` was retired (a promotion): the beats say so until it is unloaded, which the decider does once no
        gateway runs a request on it and none asks for it (tried again at each beat while one does)."""
        self._retired.add(name)
        if self._wake is not None:
            self._wake.set()
        return "left to the gateway deciding what is loaded, which unloads it once no gateway runs a request on it"

    def status(self) -> dict:
        return {n: {"state": self.decisions.get(n, {}).get("state", UNLOADED), "gib": m.gib,
                    "in_flight": self.in_flight[n], "waiting": self.waiting[n], "idle_unload_s": m.idle_unload_s}
                for n, m in self.models.items()}

    # ------------------------------------------------------------------------------------------- the beat

    async def run(self) -> None:
        """Forever: beat, and decide while this gateway holds the lease. On a clean stop its row and lease go at once."""
        self._wake = asyncio.Event()
        try:
            while True:
                try:
                    await self._beat()
                except LostLease:  # a decision found the lease gone: the next beat stops the rest
                    pass
                except sa_exc.OperationalError as exc:  # the database is down: decisions wait for it
                    log.warning("the residency store is unreachable (%s); trying again in %.1f s", exc.orig, BEAT_S)
                except Exception:  # the loop must survive anything
                    log.exception("residency beat failed")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BEAT_S):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            await self._stop_work()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._leave)

    async def _stop_work(self) -> None:
        """Stop the loads and unloads under way (the lease is lost, or the gateway stops): the next decider finishes
        them."""
        tasks = list(self._work.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _beat(self) -> None:
        if not self._schema:
            await asyncio.to_thread(upgrade, self.engine)
            self._schema = True
        self.decisions, seen = await asyncio.to_thread(self._read)
        self._retired -= {n for n in self._retired if self.decisions.get(n, {}).get("state") in (UNLOADED, FAILED)}
        # what this gateway's requests hold, counted after the decisions were read: any request started from here on
        # has seen them
        mono = time.monotonic()
        row = {"name": self.name, "beat_at": time.time(), "seen": seen, **self._own_row()}
        was = self.deciding
        taken = await asyncio.to_thread(self._publish, row)
        self._beat_ok = mono
        if taken:
            self._until = mono + self.settings.residency_lease_s
        elif self.deciding:
            self._lost()
        if not self.deciding:
            await self._stop_work()  # what it had under way is the next decider's (nothing when it had none)
            return
        if not was:
            await self._take_over()
        await self._decide()

    def _lost(self) -> None:
        log.warning("this gateway no longer decides what is loaded: another took the lease")
        self._until = 0.0

    def _own_row(self) -> dict:
        """What this gateway's requests want and hold, and what was retired through it."""
        now, mono = time.time(), time.monotonic()
        return {"wanted": sorted(n for n, c in self.waiting.items() if c > 0), "retired": sorted(self._retired),
                "in_flight": {n: c for n, c in self.in_flight.items() if c > 0},
                "last_used": {n: now - (mono - t) for n, t in self.last_used.items()}}

    def _read(self) -> tuple[dict[str, dict], int]:
        with self.engine.connect() as db:
            rows = {r.model: dict(r._mapping) for r in db.execute(sa.select(decisions))}
        return rows, max((r["epoch"] for r in rows.values()), default=0)

    def _publish(self, row: dict) -> bool:
        """Write this gateway's row; keep or take the decider's lease where it is this gateway's or has lapsed."""
        insert, now, until = insert_for(self.engine), row["beat_at"], row["beat_at"] + self.settings.residency_lease_s
        with self.engine.begin() as db:
            db.execute(insert(gateways).values(**row).on_conflict_do_update(
                index_elements=["name"], set_={k: v for k, v in row.items() if k != "name"}))
            db.execute(gateways.delete().where(gateways.c.beat_at < now - 60 * self.settings.residency_lease_s))
            db.execute(insert(leases).values(name=LEASE, holder=self.name, until=until).on_conflict_do_nothing())
            taken = db.execute(leases.update().where(leases.c.name == LEASE, sa.or_(
                leases.c.holder == self.name, leases.c.until < now)).values(holder=self.name, until=until))
            return taken.rowcount == 1

    def _live_rows(self) -> list[dict]:
        with self.engine.connect() as db:
            return [dict(r._mapping) for r in db.execute(sa.select(gateways).where(
                gateways.c.beat_at >= time.time() - self.settings.residency_lease_s, gateways.c.name != self.name))]

    async def _gateways(self) -> list[dict]:
        """Every live gateway's row, read now; this gateway's own as it stands (it follows its decisions at once)."""
        others = await asyncio.to_thread(self._live_rows)
        return [*others, {"name": self.name, "seen": float("inf"), **self._own_row()}]

    def _leave(self) -> None:
        with self.engine.begin() as db:
            db.execute(gateways.delete().where(gateways.c.name == self.name))
            db.execute(leases.delete().where(leases.c.name == LEASE, leases.c.holder == self.name))

    def _write(self, name: str, state: str, why: str | None, retry_at: float | None) -> dict:
        """Record a decision under the next epoch, in the transaction that finds this gateway's lease held and locks it
        (a gateway taking it over waits for the lock): LostLease where it is not."""
        with self.engine.begin() as db:
            held = db.execute(leases.update().where(leases.c.name == LEASE, leases.c.holder == self.name,
                                                    leases.c.until >= time.time()).values(holder=self.name))
            if held.rowcount != 1:
                raise LostLease(name)
            epoch = (db.execute(sa.select(sa.func.max(decisions.c.epoch))).scalar() or 0) + 1
            row = {"model": name, "state": state, "epoch": epoch, "changed_at": time.time(), "why": why,
                   "retry_at": retry_at}
            db.execute(insert_for(self.engine)(decisions).values(**row).on_conflict_do_update(
                index_elements=["model"], set_={k: v for k, v in row.items() if k != "model"}))
        return row

    async def _decided(self, name: str, state: str, why: str | None = None, retry_at: float | None = None) -> int:
        """Record a decision; this gateway follows it at once (the others at their next beat). Its epoch."""
        try:
            row = await asyncio.to_thread(self._write, name, state, why, retry_at)
        except LostLease:
            if self.deciding:
                self._lost()
            raise
        self.decisions[name] = row
        return row["epoch"]

    # ------------------------------------------------------------------------------------------- deciding

    async def _take_over(self) -> None:
        """Made the decider: the decisions and the backends read again, as they are now (the last decider's last
        writes included); _decide then records what the backends serve and finishes what was left mid-way."""
        log.info("this gateway (%s) now decides what is loaded", self.name)
        metrics.RESIDENCY_TAKEOVERS.inc()
        self.decisions, _ = await asyncio.to_thread(self._read)
        await self.registry.refresh()

    async def _decide(self) -> None:
        self._live = await self._gateways()
        wanted = {n for g in self._live for n in g["wanted"]}
        retired = {n for g in self._live for n in g.get("retired") or ()} - wanted
        busy, last = self._busy(), self._last_used()
        now, pinned = time.time(), self.pinned()
        for name, model in self.models.items():
            if name in self._work or name in self._draining:
                continue
            decision = self.decisions.get(name, {})
            state = decision.get("state", UNLOADED)
            if name in wanted and not (state == LOADED and self.serving(name)) and not self._failed_now(name):
                self._start(name, self._load(name))
            elif state in (UNLOADED, FAILED) and self.serving(name):  # back by itself (a restarted engine, awake)
                await self._decided(name, LOADED)
            elif state == LOADED and not self.serving(name):  # gone by itself (its server restarted)
                await self._decided(name, UNLOADED)
            elif state in (LOADING, UNLOADING) and name not in wanted:  # left mid-way by a decider that died
                self._start(name, self._drain(name, "left by the last decider", idle=False))
            elif state == LOADED and name in retired and busy[name] <= 0:
                self._start(name, self._drain(name, "retired", idle=False))
            elif state == LOADED and model.idle_unload_s and busy[name] <= 0 and name not in pinned and \
                    now - max(last.get(name, 0.0), decision.get("changed_at") or 0.0) >= model.idle_unload_s:
                self._start(name, self._drain(name, "idle", idle=True))

    def _busy(self, rows: list[dict] | None = None) -> Counter[str]:
        busy: Counter[str] = Counter()
        for g in self._live if rows is None else rows:
            busy.update(g["in_flight"])
        return busy

    def _last_used(self) -> dict[str, float]:
        last: dict[str, float] = {}
        for g in self._live:
            for name, at in g["last_used"].items():
                last[name] = max(last.get(name, 0.0), at)
        return last

    def _start(self, name: str, work: Coroutine) -> None:
        task = self._work[name] = asyncio.create_task(work)

        def done(t: asyncio.Task) -> None:
            self._work.pop(name, None)
            if t.cancelled() or isinstance(t.exception(), LostLease):
                log.info("deciding on %s stopped: the next decider finishes it", name)
            elif t.exception() is not None:
                log.error("deciding on %s failed", name, exc_info=t.exception())

        task.add_done_callback(done)

    async def _load(self, name: str) -> None:
        async with self._one_at_a_time():  # room is made one load at a time; the loads themselves then overlap
            await self._decided(name, LOADING)
            if not await self._room_for(name):
                return
            replicas = [r for r in self.registry.replicas if r.up and r.backend.swaps and name in r.models]
            if not replicas:
                await self._decided(name, FAILED, "no live backend can load it",
                                    time.time() + self.settings.load_retry_s)
                return
            self._loading.add(name)
        try:
            await self._load_on(name, replicas)  # loads it, waits for its first answer; a failure counts its backoff
        except GatewayError:
            _, retry_at, why = self._failures[name]
            await self._decided(name, FAILED, why, time.time() + retry_at - time.monotonic())
            return
        finally:
            self._loading.discard(name)
        await self._decided(name, LOADED)

    async def _room_for(self, name: str) -> bool:
        """Unload the least recently used models no gateway runs a request on (or wants) until `name` fits in
        swap_room_gib; wait up to load_wait_s for one to go idle. False: no room yet (the decision says why; the model
        is tried again at the next beat while a gateway wants it)."""
        room, need = self.settings.swap_room_gib, self.models[name].gib
        deadline = time.monotonic() + self.settings.load_wait_s
        while self.used_gib(leaving_out=name) + need > room + 1e-9:
            self._live = await self._gateways()
            wanted, busy, last = {n for g in self._live for n in g["wanted"]}, self._busy(), self._last_used()
            pinned = self.pinned()
            idle = sorted((n for n in self.resident() if n != name and busy[n] <= 0 and n not in pinned | wanted
                           and n not in self._draining and n not in self._work), key=lambda n: last.get(n, 0.0))
            if idle and await self._drain(idle[0], "room", idle=False):
                continue
            why = (f"needs {need:g} GiB and the on-demand room ({room:g} GiB) is held by models serving requests "
                   f"({', '.join(self.resident())})")
            if time.monotonic() >= deadline or not self.deciding:
                await self._decided(name, UNLOADED, why)
                return False
            if self.decisions.get(name, {}).get("why") != why:
                await self._decided(name, LOADING, why)
            await asyncio.sleep(WAIT_S)
        return True

    async def _drain(self, name: str, reason: str, idle: bool) -> bool:
        """Announce `name`'s unload, wait until every live gateway has read it and runs nothing on it, then unload it.
        `idle`: called off (the model stays loaded) when a gateway runs a request on it or wants it. True: unloaded."""
        self._draining.add(name)
        try:
            epoch = await self._decided(name, UNLOADING, reason)
            deadline = time.monotonic() + self.settings.load_wait_s
            while True:
                if not self.deciding:  # another gateway decides now: it finishes this
                    return False
                live = await self._gateways()
                read = [g for g in live if g["seen"] >= epoch]
                busy = self._busy(read)[name]
                if idle and (busy > 0 or any(name in g["wanted"] for g in read)):
                    await self._decided(name, LOADED)
                    return False
                if len(read) == len(live) and busy <= 0:
                    break
                if time.monotonic() >= deadline:
                    log.warning("model %s not unloaded (%s): gateways still run requests on it", name, reason)
                    await self._decided(name, LOADED)
                    return False
                await asyncio.sleep(WAIT_S)
            await self._unload(name, reason)
            if self.serving(name):  # the backend refused (logged): it stays loaded
                await self._decided(name, LOADED)
                return False
            await self._decided(name, UNLOADED)
            return True
        finally:
            self._draining.discard(name)

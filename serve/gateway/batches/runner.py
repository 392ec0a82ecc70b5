"""The batch runner: each line of a batch sent through the gateway's own front door, as the key that made the batch,
at batch priority.

A line is an in-process HTTP request to the gateway app (httpx's ASGI transport), so that it passes everything a
live request passes: admission, the key's scope and quotas, the route's bounds, routing, retries and breakers, the
metrics and the usage log. It waits behind interactive requests wherever requests wait (the gateway's gate and
per-model gates queue by priority; vLLM too, with `vllm_priority`): its key's priority, or `batch` if that is
later. A line refused for load (429 or 503) is sent again later, honouring Retry-After, until the batch expires;
any other answer is the line's, kept in SQLite (store.py) the moment it arrives.

Every gateway worker has a runner; each batch is run by the one holding its lease in the store (store.py), renewed
every POLL_S. A runner that dies (its worker, its pod) stops renewing, and after `batch_lease_s` another runner takes
the batch over and carries on from the lines not yet answered; a runner that finds its lease taken stops that batch.
Over every gateway of a store, at most `batch_parallel` batches run side by side, oldest first, each with
`batch_concurrency` lines in flight. A line in flight when its runner died is sent again by the next one; its answer
is recorded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping

import httpx
import orjson
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from tenacity import AsyncRetrying, retry_if_result, wait_exponential

from .. import metrics
from ..access.caller import RUN_AS, Access
from ..access.keys import PRIORITIES, ApiKey
from ..exceptions import InvalidRequest
from ..settings import GatewaySettings
from . import lines as batch_lines
from .store import Store

log = logging.getLogger("rtxserve.gateway.batches")
POLL_S = 1.0
RETRY_STATUS = (429, 503)  # load, not the line: sent again
ANONYMOUS = ""  # the owner of everything on a gateway without keys


def output_file_ids(batch_id: str) -> tuple[str, str]:
    """A batch's output and error file ids: fixed by its id, so that a finalisation redone after a restart writes the
    same files again rather than new ones."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-out-{suffix}", f"file-err-{suffix}"


def _store_down(exc: BaseException) -> sa_exc.OperationalError | None:
    """The store's OperationalError (its database unreachable) that `exc` is or holds (a line's worker raised it
    inside run_batch's task group)."""
    if isinstance(exc, sa_exc.OperationalError):
        return exc
    group = exc.subgroup(sa_exc.OperationalError) if isinstance(exc, BaseExceptionGroup) else None
    return _store_down(group.exceptions[0]) if group else None


class BatchRunner:
    def __init__(self, settings: GatewaySettings, access: Access, endpoints: Mapping[str, type[BaseModel]]):
        """`endpoints`: each endpoint a batch may name -> the request type its route accepts."""
        self.settings, self.access, self.endpoints = settings, access, endpoints
        self._password = settings.batch_store_password()  # an unreadable password file stops the start, here
        self._store: Store | None = None
        self._opening = asyncio.Lock()
        self._failed: tuple[float, sa_exc.OperationalError] | None = None  # the last failed open: until when it stands
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"  # this runner, in the leases
        self._wake = asyncio.Event()

    @property
    def store(self) -> Store:
        """The store, once open() has opened it (the routes and the runner's loop open it before anything else)."""
        if self._store is None:
            raise RuntimeError("the batch store is used before it was opened")
        return self._store

    async def open(self) -> Store:
        """The store, opened (and brought to the current schema) on first use, off the event loop: a gateway whose
        database is down when it starts serves everything else, and its Files and Batch APIs answer 503 until the
        database answers. A failed open stands for POLL_S: the requests meanwhile are answered at once, not each after
        a connect timeout of its own."""
        if self._store is not None:
            return self._store
        async with self._opening:
            if self._store is None:
                if self._failed is not None and time.monotonic() < self._failed[0]:
                    raise self._failed[1]
                try:
                    self._store = await asyncio.to_thread(Store, self.settings.batch_dir, self.settings.batch_store_url,
                                                          self._password)
                except sa_exc.OperationalError as exc:
                    self._failed = (time.monotonic() + POLL_S, exc)
                    raise
        return self._store

    def wake(self) -> None:
        """A batch was made or cancelled in this worker: look now rather than at the next poll."""
        self._wake.set()

    async def read(self, batch: dict) -> list[batch_lines.Line]:
        async with self.store.local_async(batch["input_file_id"]) as path:
            lines, _ = await batch_lines.read(path, batch["endpoint"], self.endpoints[batch["endpoint"]],
                                              self.settings.batch_max_requests)
        return lines

    def caller(self, owner: str) -> ApiKey | None:
        """The key a batch of `owner`'s runs as, at batch priority at the earliest; None once the key is revoked."""
        if self.access.keys is None:
            return ApiKey(name="batch", hash="sha256:-", priority=PRIORITIES["batch"])
        key = self.access.keys.named(owner)
        return dataclasses.replace(key, priority=max(key.priority, PRIORITIES["batch"])) if key else None

    async def run(self, app) -> None:
        """Forever: sweep expired files, keep the leases of the batches this runner runs (stopping any another runner
        took), and claim the oldest batches no runner holds while fewer than `batch_parallel` run in all."""
        running: dict[str, asyncio.Task] = {}
        lease_s = self.settings.batch_lease_s
        try:
            while True:
                try:
                    await self._step(app, running, lease_s)
                except sa_exc.OperationalError as exc:  # the database is down: what runs stops at its next write
                    log.warning("the batch store is unreachable (%s); trying again in %.0f s", exc.orig, POLL_S)
                except Exception:  # anything else (a migration the database refused): logged, and tried again
                    log.exception("the batch runner's look at the store failed; trying again in %.0f s", POLL_S)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)

    async def _step(self, app, running: dict[str, asyncio.Task], lease_s: float) -> None:
        """One look at the store: sweep, renew, claim."""
        store = await self.open()
        for file_id in await asyncio.to_thread(store.expire_files):
            log.info("file %s expired: deleted", file_id)
        for batch_id in [b for b, task in running.items() if task.done()]:
            del running[batch_id]
        held = await asyncio.to_thread(store.renew, self.name, running, lease_s)
        for batch_id in set(running) - held:
            log.warning("batch %s: another runner took it over (this one missed its lease); stopping here",
                        batch_id)
            running.pop(batch_id).cancel()
        for batch_id in await asyncio.to_thread(store.active):
            if len(running) >= self.settings.batch_parallel:
                break
            if batch_id not in running and await asyncio.to_thread(
                    store.claim, batch_id, self.name, lease_s, self.settings.batch_parallel):
                running[batch_id] = asyncio.create_task(self._run_guarded(app, batch_id))
                running[batch_id].add_done_callback(lambda _: self._wake.set())

    async def _run_guarded(self, app, batch_id: str) -> None:
        try:
            await self.run_batch(app, batch_id)
        except Exception as exc:
            if down := _store_down(exc):  # the batch is left as it is, for a runner to take up again once it is back
                log.warning("batch %s: the batch store is unreachable (%s); a runner takes it up again once it is back",
                            batch_id, down.orig)
                return
            # a fault of ours: the batch ends failed, the others still run
            log.exception("batch %s: unexpected error", batch_id)
            await self.fail(batch_id, "internal_error", "the gateway failed running this batch; its log says why")
        finally:  # ended (or stopped here): another runner may take what is left at once
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.release, batch_id, self.name)

    async def fail(self, batch_id: str, code: str, message: str, line: int | None = None) -> None:
        log.warning("batch %s failed: %s", batch_id, message)
        await asyncio.to_thread(self.store.set_status, batch_id, "failed", errors={
            "object": "list", "data": [{"code": code, "message": message, "param": None, "line": line}]})
        metrics.BATCHES.labels("failed").inc()

    async def run_batch(self, app, batch_id: str) -> None:
        store = self.store
        batch = await asyncio.to_thread(store.batch, batch_id)
        key = self.caller(batch["owner"])
        try:
            if key is None:
                raise InvalidRequest(f"the API key {batch['owner']!r} that made the batch no longer exists")
            lines = await self.read(batch)
        except InvalidRequest as exc:  # the gateway's settings changed since the batch was made
            await self.fail(batch_id, exc.code, exc.message, getattr(exc, "line", None))
            return
        await asyncio.to_thread(store.set_status, batch_id, "in_progress", only_from=("validating",))
        done = await asyncio.to_thread(store.done_lines, batch_id)
        todo = asyncio.Queue()
        for line in lines:
            if line.number not in done:
                todo.put_nowait(line)
        log.info("batch %s: %d of %d lines to run", batch_id, todo.qsize(), len(lines))

        async def as_key(scope, receive, send):
            scope.setdefault("state", {})[RUN_AS] = key
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=as_key, raise_app_exceptions=False)  # a 500 is the line's answer
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            async with asyncio.TaskGroup() as group:
                for _ in range(self.settings.batch_concurrency):
                    group.create_task(self._work(client, batch, todo))
        await self.finish(batch_id)

    async def _stopped(self, batch: dict) -> str | None:
        """Why no more of `batch`'s lines are sent: "batch_cancelled", "batch_expired", or None."""
        status = await asyncio.to_thread(self.store.status, batch["id"])
        if status == "cancelling":
            return "batch_cancelled"
        return "batch_expired" if time.time() >= batch["expires_at"] else None

    async def _work(self, client: httpx.AsyncClient, batch: dict, todo: asyncio.Queue) -> None:
        while not todo.empty():
            line = todo.get_nowait()
            stopped = await self._stopped(batch)
            if stopped:
                await self._never_ran(batch, line, stopped)
                continue
            response = await self._send(client, batch, line)
            # refused for load until the batch was stopped: it never ran, and is cancelled (or expired) as the unsent
            if response.status_code in RETRY_STATUS and (stopped := await self._stopped(batch)):
                await self._never_ran(batch, line, stopped)
                continue
            metrics.BATCH_LINES.labels(str(response.status_code)).inc()
            await asyncio.to_thread(self.store.record, batch["id"], line.number, line.custom_id,
                                    response.headers.get("x-request-id"), response.status_code, response.content)

    async def _never_ran(self, batch: dict, line: batch_lines.Line, stopped: str) -> None:
        message = {"batch_cancelled": "the batch was cancelled before this request ran",
                   "batch_expired": "the batch expired before this request ran"}[stopped]
        await asyncio.to_thread(self.store.record, batch["id"], line.number, line.custom_id, None, 0,
                                orjson.dumps({"code": stopped, "message": message}))
        metrics.BATCH_LINES.labels("0").inc()

    async def _send(self, client: httpx.AsyncClient, batch: dict, line: batch_lines.Line) -> httpx.Response:
        """The line's answer; one refused for load is sent again (after its Retry-After at least) until the batch
        is stopped."""
        def wait(state) -> float:
            retry_after = state.outcome.result().headers.get("retry-after", "")
            return max(float(retry_after) if retry_after.isdigit() else 0.0, backoff(state))

        async def give_up(state) -> bool:
            return await self._stopped(batch) is not None

        backoff = wait_exponential(multiplier=0.5, max=30)
        body = orjson.dumps(line.body)
        async for attempt in AsyncRetrying(retry=retry_if_result(lambda r: r.status_code in RETRY_STATUS),
                                           wait=wait, stop=give_up, retry_error_callback=lambda s: s.outcome.result()):
            with attempt:
                response = await client.post(batch["endpoint"], content=body,
                                             headers={"content-type": "application/json"})
            if not attempt.retry_state.outcome.failed:
                attempt.retry_state.set_result(response)
        return response

    async def finish(self, batch_id: str) -> None:
        """Write the output and error files from the answers, and end the batch: cancelled, expired or completed."""
        store = self.store
        await asyncio.to_thread(store.set_status, batch_id, "finalizing", only_from=("in_progress", "cancelling"))
        batch = await asyncio.to_thread(store.batch, batch_id)
        output_id, error_id, expired = await asyncio.to_thread(self._write_outputs, batch)
        end = "cancelled" if batch["cancelling_at"] else "expired" if expired else "completed"
        await asyncio.to_thread(store.set_status, batch_id, end, only_from=("finalizing",),
                                output_file_id=output_id, error_file_id=error_id)
        metrics.BATCHES.labels(end).inc()
        log.info("batch %s %s: %s", batch_id, end, batch["request_counts"])

    def _write_outputs(self, batch: dict) -> tuple[str | None, str | None, bool]:
        """OpenAI's output lines, in the input's order: a 2xx answer to the output file, any other to the error file
        (with its answer, or with `error` where there was none). The ids of the files written (None: no line for
        it), and whether expiry left a line unrun."""
        ids, expired = list(output_file_ids(batch["id"])), False
        results = list(self.store.results(batch["id"]))  # read once, split between the two files
        for index, ok in ((0, True), (1, False)):
            rows = [r for r in results if (200 <= r["status_code"] < 300) == ok]
            if not rows:
                ids[index] = None
                continue
            lines = []
            for r in rows:
                answer, error = None, None
                if r["status_code"]:
                    answer = {"status_code": r["status_code"], "request_id": r["request_id"],
                              "body": orjson.loads(r["body"]) if r["body"] else None}
                else:
                    error = orjson.loads(r["body"])
                    expired = expired or error["code"] == "batch_expired"
                lines.append(orjson.dumps({"id": f"batch_req_{batch['id'].removeprefix('batch_')}_{r['line']}",
                                           "custom_id": r["custom_id"], "response": answer, "error": error}) + b"\n")
            size = self.store.write_file(ids[index], lines)
            self.store.add_file(ids[index], batch["owner"], f"{batch['id']}_{'output' if ok else 'error'}.jsonl",
                                "batch_output", size, batch["output_expires_s"] or self.settings.batch_files_expire_s)
        return ids[0], ids[1], expired

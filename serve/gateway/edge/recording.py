"""The gateway's traffic trace (`trace_dir`): one JSON line per model request, for replaying real traffic against a
candidate box (`rtxserve loadtest replay`, issue 43). Off by default.

A line holds what a replay needs and nothing a user wrote: the arrival time (`t`, Unix seconds), the route, the
model that answered, a hash of the key's name, the input's size (prompt tokens for generation; items and characters
for text encoders, images for vision), the output tokens, the status, the latency and, for streams, the time to
the first chunk, and for generation the prompt's prefix-block hashes (`hash_ids`, as Mooncake's traces have them:
two requests that share their first blocks share their first ids), for encoders a hash of the inputs
(`input_hash`: a repeated input repeats it). Never text, images or audio. Batch lines are
marked `batch`.

Each gateway worker writes its own file (`trace-HOST-PID.jsonl`: on a volume several pods share, their files do not
collide, a container's PID being 1 in each), rotated by size (`trace_max_bytes`, `trace_backups`
kept) by logging's RotatingFileHandler, in batches (TraceWriter): a record per line through a logging queue cost
B1 +0.07 to +0.1 CPU-ms a request (the record, and the writer thread's turns on the GIL); in batches, +0.03.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
from contextvars import ContextVar
from logging.handlers import RotatingFileHandler
from pathlib import Path

import orjson

from ..access.caller import RUN_AS

FLUSH_S = 0.5  # the longest a line waits to be written (what a crash may lose)
FLUSH_LINES = 1000  # or until this many wait
# The trace line of the request being served; None when tracing is off or the request is not traced.
TRACE: ContextVar[dict | None] = ContextVar("rtxserve_trace", default=None)


def note(**fields) -> None:
    """Add facts to the trace line of the request being served, if it is traced."""
    line = TRACE.get()
    if line is not None:
        line.update(fields)


def note_inputs(items: str | list) -> None:
    """A text or image request's size: its texts and their characters, or its images; and a hash of them all, so that
    a replay repeats what was repeated (what a response cache answers), knowing nothing of what it was."""
    line = TRACE.get()
    if line is not None:
        items = [items] if isinstance(items, str) else items  # one text, or a list of texts or of images
        texts = [i for i in items if isinstance(i, str)]
        digest = hashlib.blake2b(digest_size=6)
        for item in items:
            digest.update((item if isinstance(item, str) else item.image).encode())
            digest.update(b"\x00")
        line.update(items=len(items), chars=sum(map(len, texts)), images=len(items) - len(texts),
                    input_hash=int.from_bytes(digest.digest(), "big"))


def note_first_chunk() -> None:
    """A stream's first chunk is on its way: its time from the request's arrival (TTFT as the client sees it)."""
    line = TRACE.get()
    if line is not None:
        line["ttft_ms"] = round((time.time() - line["t"]) * 1000, 2)


def hash_ids(blocks) -> list[int]:
    """Prefix-block hashes as Mooncake's integer ids (48 bits of each chained hash)."""
    return [int.from_bytes(b[:6], "big") for b in blocks]


def key_hash(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=6).hexdigest()


class TraceWriter:
    """One worker's trace file. A request only adds its line to a list; the list is written as one record every
    FLUSH_S (or FLUSH_LINES), and when the gateway stops (its lifespan's end: uvicorn ends the process by the signal
    it caught, so nothing at exit would run)."""

    def __init__(self, directory: Path, max_bytes: int, backups: int):
        directory.mkdir(parents=True, exist_ok=True)
        name = f"trace-{socket.gethostname()}-{os.getpid()}.jsonl"
        self.handler = RotatingFileHandler(directory / name, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.pending: list[str] = []

    def add(self, line: dict) -> None:
        self.pending.append(orjson.dumps(line).decode())
        if len(self.pending) >= FLUSH_LINES:
            self.flush()
        elif len(self.pending) == 1:
            asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Write the pending lines as one record (one size check for rotation, one write)."""
        if self.pending:
            text, self.pending = "\n".join(self.pending), []
            self.handler.handle(logging.makeLogRecord({"msg": text}))


class TraceMiddleware:
    """Traces every model request (POST /v1/...) but the Files and Batch APIs' own, into `writer`."""

    def __init__(self, app, *, writer: TraceWriter):
        self.app, self.writer = app, writer

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope["method"] != "POST" or not path.startswith("/v1/")
                or path.startswith(("/v1/files", "/v1/batches"))):
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        line = {"t": round(time.time(), 6), "route": path, "status": 500}
        token = TRACE.set(line)

        async def send_status(message):
            if message["type"] == "http.response.start":
                line["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            TRACE.reset(token)
            state = scope.get("state", {})
            key = state.get("api_key") or state.get(RUN_AS)
            line["latency_ms"] = round((time.perf_counter() - start) * 1000, 2)
            line.setdefault("model", state.get("model") or None)
            if key is not None:
                line["key"] = key_hash(key.name)
            if RUN_AS in state:
                line["batch"] = True
            self.writer.add(line)

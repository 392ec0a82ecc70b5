"""Raw per-request samples: one CSV row per request, written by the master (or the only) locust process.

Locust's own percentiles come from rounded buckets; reports are computed from these rows instead. Workers
send their rows to the master in batches over locust's own channel, so a run spread over several processes
or boxes still ends in one file. At the end of a headless run locust's master only tells its workers to
quit and waits half a second; here it first stops them and waits until each said it stopped, which a worker
says after its users ended and its last batch went out on the same channel.
"""

from __future__ import annotations

import csv
import time

import gevent
from locust import events
from locust.rpc import Message
from locust.runners import MasterRunner, WorkerRunner

COLUMNS = ("end", "name", "latency_ms", "ok", "error", "ttft_ms", "output_tokens", "prompt_tokens", "itl_ms", "wait_ms",
           "images", "detections", "audio_s", "process", "model", "turn", "cap_wait_ms")
MESSAGE = "rtxserve_samples"
FLUSH_EVERY_S = 1.0

_state: dict = {"writer": None, "file": None, "buffer": None, "process": "main"}


def _fmt(value, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def row(name: str, response_time: float, exception, context: dict | None, end: float) -> list:
    context = context or {}
    error = "" if exception is None else str(exception).replace("\n", " ")[:160]
    return [f"{end:.6f}", name, f"{response_time:.3f}", 0 if exception else 1, error, _fmt(context.get("ttft_ms")),
            _fmt(context.get("output_tokens")), _fmt(context.get("prompt_tokens")),
            " ".join(f"{gap:.3f}" for gap in context.get("itl_ms", ())), _fmt(context.get("wait_ms")),
            _fmt(context.get("images")), _fmt(context.get("detections")), _fmt(context.get("audio_s")), _state["process"],
            context.get("model") or "", _fmt(context.get("turn")), _fmt(context.get("cap_wait_ms"))]


@events.init.add_listener
def _open(environment, **_kwargs):
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        _state["buffer"] = []
        _state["process"] = runner.client_id  # which locust process sent the request (host and a unique id)
        gevent.spawn(_flush_loop, runner)
        return
    path = getattr(environment.parsed_options, "samples_out", "")
    if not path:
        return
    _state["file"] = open(path, "w", newline="", buffering=1 << 16)
    _state["writer"] = csv.writer(_state["file"])
    _state["writer"].writerow(COLUMNS)
    if isinstance(runner, MasterRunner):
        runner.register_message(MESSAGE, lambda msg, **_: _state["writer"].writerows(msg.data))


def _flush(runner) -> None:
    rows, _state["buffer"] = _state["buffer"], []
    if rows:
        runner.send_message(MESSAGE, rows)


def _flush_loop(runner) -> None:
    while True:
        gevent.sleep(FLUSH_EVERY_S)
        _flush(runner)


@events.test_stopping.add_listener
def _drain_workers(environment, **_kwargs):
    runner = environment.runner
    if not isinstance(runner, MasterRunner):
        return
    for client in runner.clients.all:
        runner.server.send_to_client(Message("stop", None, client.id))
    deadline = time.monotonic() + (environment.stop_timeout or 0) + 30
    while runner.user_count and time.monotonic() < deadline:
        gevent.sleep(0.2)


@events.test_stop.add_listener
def _last_batch(environment, **_kwargs):
    if _state["buffer"] is not None:
        _flush(environment.runner)


@events.request.add_listener
def _record(name, response_time, exception=None, context=None, start_time=None, **_kwargs):
    line = row(name, response_time, exception, context, time.time())
    if _state["buffer"] is not None:
        _state["buffer"].append(line)
    elif _state["writer"] is not None:
        _state["writer"].writerow(line)


@events.quit.add_listener
def _close(**_kwargs):
    if _state["file"] is not None:
        _state["file"].close()
        _state["file"] = _state["writer"] = None

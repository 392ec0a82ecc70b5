"""B1's and B1s's Python floor: the least a Python front door can do, as an ASGI app on uvicorn run as the gateway
runs (one worker, uvloop, httptools). Measured beside the gateway in the same rounds, it says how much of the gateway's
cost is its own code and how much any Python front door on this box pays (issue 53: "if Python cannot reach them on
this box, say where the floor is").

- `app` (B1, classify): read the JSON body, make the gateway's one gRPC call to Triton (the same generated stub, the
  same request), answer JSON.
- `passthrough` (B1s, streams): send the request on to vLLM's HTTP server with the gateway's client (aiohttp, a pooled
  session) and relay its answer chunk by chunk as it comes.

No keys, no validation, no metrics, no routing, no coalescing, no parsing of what streams through."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import orjson
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

NAME = "python relay"  # its path in B1's and B1s's tables
# what the relay calls: Triton's gRPC address (app), vLLM's HTTP URL (passthrough)
UPSTREAM_ENV = "RTXSERVE_BENCH_RELAY_UPSTREAM"
_state: dict = {}


def _start() -> None:
    channel = grpc.aio.insecure_channel(os.environ[UPSTREAM_ENV])
    _state["infer"] = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelInferResponse.FromString)


async def answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def lifespan(receive, send, start) -> None:
    while (await receive())["type"] == "lifespan.startup":
        start()
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def read_body(receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send, _start)
        return
    if scope["method"] == "GET":  # the readiness probe
        await answer(send, 200, b"{}")
        return
    asked = orjson.loads(await read_body(receive))
    request = service_pb2.ModelInferRequest(model_name=asked["model"])
    request.inputs.add(name="TEXT", datatype="BYTES", shape=(1, 1))
    request.raw_input_contents.append(
        serialize_byte_tensor(np.array([asked["input"].encode()], dtype=np.object_)).item())
    for name in ("LABEL", "SCORE", "PROBS"):  # what the gateway asks for
        request.outputs.add(name=name)
    response = await _state["infer"](request, timeout=30)
    raw = dict(zip((meta.name for meta in response.outputs), response.raw_output_contents))
    label = deserialize_bytes_tensor(raw["LABEL"])[0].decode()
    await answer(send, 200, orjson.dumps({"data": [{"label": label}]}))


def _open_session() -> None:
    _state["session"] = aiohttp.ClientSession(
        os.environ[UPSTREAM_ENV], connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


async def passthrough(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        await lifespan(receive, send, _open_session)
        return
    headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in (b"content-type", b"accept")}
    query = scope["query_string"].decode()
    async with _state["session"].request(scope["method"], scope["path"] + (f"?{query}" if query else ""),
                                         data=await read_body(receive), headers=headers) as response:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", response.headers.get("content-type", "").encode())]})
        async for chunk in response.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@contextlib.contextmanager
def python_relay(upstream: str, work: Path, ready_path: str = "/", app: str = "app") -> Iterator[tuple[str, int]]:
    """The relay `app` (this module's `app` or `passthrough`) on a free port in front of `upstream`: (its URL, its
    pid), stopped on exit; started once `ready_path` answers 200 through it."""
    from serve.launcher import ServerProcess, free_port

    from .proxy import running

    port = free_port()
    server = ServerProcess(
        "python relay", [sys.executable, "-m", "uvicorn", f"bench.relay:{app}", "--port", str(port), "--log-level",
                         "warning", "--no-access-log", "--loop", "uvloop", "--http", "httptools"],
        env={**os.environ, UPSTREAM_ENV: upstream}, cwd=Path(__file__).resolve().parents[1],
        log_path=work / "relay.log", ready_url=f"http://127.0.0.1:{port}{ready_path}")
    with running(server, port, 60) as started:
        yield started

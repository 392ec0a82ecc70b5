"""B1's Python floor: the least a Python front door can do for a classify request, as an ASGI app on uvicorn run as
the gateway runs (one worker, uvloop, httptools): read the JSON body, make the gateway's one gRPC call to Triton
(the same generated stub, the same request), answer JSON. No keys, no validation, no metrics, no routing, no
coalescing. Measured beside the gateway in the same rounds, it says how much of the gateway's cost is its own code and
how much any Python front door on this box pays (issue 53: "if Python cannot reach them on this box, say where the
floor is")."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import orjson
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

TRITON_ENV = "RTXSERVE_BENCH_RELAY_TRITON"  # the Triton gRPC address the relay calls
_state: dict = {}


def _start() -> None:
    channel = grpc.aio.insecure_channel(os.environ[TRITON_ENV])
    _state["infer"] = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelInferResponse.FromString)


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            _start()
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["method"] == "GET":  # the readiness probe
        await _answer(send, 200, b"{}")
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    asked = orjson.loads(body)
    request = service_pb2.ModelInferRequest(model_name=asked["model"])
    request.inputs.add(name="TEXT", datatype="BYTES", shape=(1, 1))
    request.raw_input_contents.append(
        serialize_byte_tensor(np.array([asked["input"].encode()], dtype=np.object_)).item())
    for name in ("LABEL", "SCORE", "PROBS"):  # what the gateway asks for
        request.outputs.add(name=name)
    response = await _state["infer"](request, timeout=30)
    raw = dict(zip((meta.name for meta in response.outputs), response.raw_output_contents))
    label = deserialize_bytes_tensor(raw["LABEL"])[0].decode()
    await _answer(send, 200, orjson.dumps({"data": [{"label": label}]}))


@contextlib.contextmanager
def python_relay(triton_grpc: str, work: Path) -> Iterator[tuple[str, int]]:
    """The relay on a free port in front of `triton_grpc`: (its URL, its pid), stopped on exit."""
    from serve.launcher import ServerProcess, free_port

    port = free_port()
    server = ServerProcess(
        "python relay", [sys.executable, "-m", "uvicorn", "bench.relay:app", "--port", str(port), "--log-level",
                         "warning", "--no-access-log", "--loop", "uvloop", "--http", "httptools"],
        env={**os.environ, TRITON_ENV: triton_grpc}, cwd=Path(__file__).resolve().parents[1],
        log_path=work / "relay.log", ready_url=f"http://127.0.0.1:{port}/")
    server.start(60)
    try:
        yield f"http://127.0.0.1:{port}", server.process.pid
    finally:
        server.stop()

"""B1s's front ends against a synthetic engine: what each costs a streamed token when nothing else wants the cores.

In B1s (bench/streams.py) vLLM shares the box's cores with the front end it is measured through, so every path's
tokens/s moves with the machine (rounds of one run spread by a third on a shared 2-core box), and a front end's cost
shows only as the engine's loss. Here `engine`, a few lines of ASGI that answer a streamed completion as vLLM does
(`tokens` token events `gap_s` apart, the usage event, [DONE]; vLLM's own JSON shapes), stands in for vLLM: it costs
next to nothing, so each front end's CPU per token (user + system seconds of its processes over a run, over the tokens
its clients received) is its own, and the gateway's over the Python relay's is what the gateway's code adds to a
stream. Beside it, each front end's read and write system calls a token (its /proc/PID/io counts): the same calls for
two front ends, and their CPU differs by what each runs between them. Paths: nginx, the Python relay (bench/relay.py's passthrough) and the gateway, in rotating order per round, the
same closed loop of `streams` clients (aiohttp, in this process) through each for `duration_s`; each figure is the
median over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from .relay import answer, lifespan, read_body

SERVED = "bench-llm"
TOKENS_ENV, GAP_ENV = "RTXSERVE_BENCH_ENGINE_TOKENS", "RTXSERVE_BENCH_ENGINE_GAP_S"
_TOKEN = (b'data: {"id":"cmpl-bench","object":"text_completion","created":1764000000,"model":"' + SERVED.encode()
          + b'","choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n')


async def engine(scope, receive, send) -> None:
    """The synthetic vLLM: /health, /v1/models, /openapi.json (a generator's routes) and streamed /v1/completions."""
    if scope["type"] == "lifespan":
        return await lifespan(receive, send, lambda: None)
    path = scope["path"]
    if path == "/v1/models":
        return await answer(send, 200, orjson.dumps(
            {"object": "list", "data": [{"id": SERVED, "object": "model", "max_model_len": 512}]}))
    if path == "/openapi.json":
        return await answer(send, 200, b'{"paths": {"/v1/completions": {}, "/v1/chat/completions": {}}}')
    if path != "/v1/completions":
        return await answer(send, 200, b"{}")  # /health
    tokens, gap = int(os.environ.get(TOKENS_ENV, "64")), float(os.environ.get(GAP_ENV, "0.004"))
    if not orjson.loads(await read_body(receive)).get("stream"):  # the gateway's readiness canary
        return await answer(send, 200, orjson.dumps({
            "id": "cmpl-bench", "object": "text_completion", "model": SERVED, "choices": [
                {"index": 0, "text": " tok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(tokens):
        await asyncio.sleep(gap)
        await send({"type": "http.response.body", "body": _TOKEN, "more_body": True})
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3}
    await send({"type": "http.response.body", "more_body": True, "body": b'data: {"id":"cmpl-bench","object":'
                b'"text_completion","created":1764000000,"model":"' + SERVED.encode() + b'","choices":[],"usage":'
                + orjson.dumps(usage) + b"}\n\ndata: [DONE]\n\n"})
    await send({"type": "http.response.body", "body": b""})


async def _load(url: str, streams: int, tokens: int, seconds: float) -> tuple[int, int]:
    """`streams` clients, each streaming completions back to back for `seconds`: (token events received, failed)."""
    import aiohttp

    received, failed = [0], [0]
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client() -> None:
            while time.monotonic() < deadline:
                async with session.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "stream": True,
                                                                      "max_tokens": tokens}) as response:
                    body = await response.read()
                if response.status != 200 or not body.endswith(b"data: [DONE]\n\n"):
                    failed[0] += 1
                received[0] += body.count(b'"choices":[{')

        await asyncio.gather(*(client() for _ in range(streams)))
    return received[0], failed[0]


def run(out: Path, *, rounds: int = 5, streams: int = 16, tokens: int = 64, gap_s: float = 0.004,
        duration_s: float = 8.0, progress=print) -> dict:
    """Each front end's CPU-us per token over the rounds, and the gateway's over the relay's."""
    from serve.launcher import ServerProcess, free_port
    from serve.stack import start_gateway

    from .profile import cpu_seconds, system_calls
    from .proxy import plain_proxy
    from .relay import NAME as RELAY
    from .relay import python_relay

    (out / "gateway").mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, TOKENS_ENV: str(tokens), GAP_ENV: str(gap_s)}
    progress(f"a synthetic engine ({tokens} token events {gap_s * 1e3:g} ms apart) behind each front end")
    with contextlib.ExitStack() as stack:
        argv = [sys.executable, "-m", "uvicorn", "bench.stream_cost:engine", "--port", str(port), "--loop", "uvloop",
                "--http", "httptools", "--log-level", "warning", "--no-access-log"]
        upstream = ServerProcess(
            "synthetic engine", argv, env=env, cwd=Path(__file__).resolve().parents[1],
            log_path=out / "synthetic-engine.log", ready_url=f"http://127.0.0.1:{port}/health").start(60)
        stack.callback(upstream.stop)
        url = f"http://127.0.0.1:{port}"
        gateway, via_gateway = start_gateway("", out / "gateway", vllm_url=url)
        stack.callback(gateway.stop)
        proxy = stack.enter_context(plain_proxy(f"127.0.0.1:{port}", Path(stack.enter_context(
            tempfile.TemporaryDirectory())), "/v1/models"))
        relay = stack.enter_context(python_relay(url, out, "/v1/models", app="passthrough"))
        paths = {"proxy": proxy, RELAY: relay, "gateway": (via_gateway, gateway.process.pid)}
        names = tuple(paths)
        figures: dict[str, list[float]] = {name: [] for name in names}
        calls: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        failed = 0
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                target, pid = paths[name]
                before, made = cpu_seconds(pid), system_calls(pid)
                received, lost = asyncio.run(_load(target, streams, tokens, duration_s))
                figures[name].append((cpu_seconds(pid) - before) * 1e6 / max(received, 1))
                calls[name].append(tuple((after - was) / max(received, 1) for after, was in zip(system_calls(pid), made)))
                failed += lost
                progress(f"synthetic engine, round {r + 1}/{rounds}, {name}: {figures[name][-1]:.1f} CPU-us a token")
    medians = {name: round(statistics.median(values), 2) for name, values in figures.items()}
    return {"streams": streams, "tokens": tokens, "gap_s": gap_s, "duration_s": duration_s, "rounds": rounds,
            "cpu_us_per_token": medians, "runs": figures, "failed": failed,
            "calls_per_token": {name: [round(statistics.median(c[i] for c in made), 3) for i in (0, 1)]
                                for name, made in calls.items()},
            "gateway_over_relay": round(medians["gateway"] / medians[RELAY], 3),
            "gateway_added_us": round(medians["gateway"] - medians[RELAY], 2)}


def markdown(result: dict) -> list[str]:
    cost = result["cpu_us_per_token"]
    return [f"Against a synthetic engine (bench/stream_cost.py: {result['tokens']} token events "
            f"{result['gap_s'] * 1e3:g} ms apart, {result['streams']} streams, {result['duration_s']:g} s a path, "
            f"median of {result['rounds']} rotating rounds; {result['failed']} streams failed), each front end's own "
            "CPU per streamed token, with no engine beside it on the cores:", "",
            "| path | CPU-us a token | read() / write() calls a token (/proc/PID/io: nginx's recv() is not one) |", "|---|---|---|",
            *(f"| {name} | {value} | {' / '.join(map(str, result.get('calls_per_token', {}).get(name, ['–'])))} |"
              for name, value in cost.items()), "",
            f"The gateway's code adds {result['gateway_added_us']} us a token to the Python relay's "
            f"({result['gateway_over_relay']}x its CPU): what a change to the gateway can win on a stream."]

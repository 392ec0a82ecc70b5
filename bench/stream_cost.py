"""B1s's front ends against a synthetic engine: what each costs a streamed token when nothing else wants the cores.

In B1s (bench/streams.py) vLLM shares the box's cores with the front end it is measured through, so every path's
tokens/s moves with the machine (rounds of one run spread by a third on a shared 2-core box), and a front end's cost
shows only as the engine's loss. Here `engine`, a few lines of ASGI that answer a streamed completion as vLLM does
(`max_tokens` token events `gap_s` apart, the usage event, [DONE]; vLLM's own JSON shapes), stands in for vLLM: it
costs next to nothing, so each front end's CPU per token (user + system seconds of its processes over a run, over the
tokens its clients received) is its own, and the gateway's over the Python relay's is what the gateway's code adds to a
stream. Beside it, each front end's read and write system calls a token (its /proc/PID/io counts): the same calls for
two front ends, and their CPU differs by what each runs between them.

A front end's CPU over a run is what it spends once per request (reading and checking it, keys, routing, opening the
upstream stream, counting its usage) and what it spends per token relayed. Each round runs every path at two stream
lengths, `short` tokens and `tokens`; a least-squares fit of each path's runs (CPU = a x requests + b x tokens) splits
its cost into the two (`per_request_us`, `per_token_us`), so that the gateway's excess over the relay is said as
per-request work spread over a stream's tokens, or work on each token. After the rounds, py-spy samples the relay and
the gateway at both lengths: each part's CPU (bench/profile.py's parts: the gateway's own code, the HTTP server, the
event loop, the HTTP client...) split the same way, so that the excess is named by the code that spends it.

Paths: nginx, the Python relay (bench/relay.py's passthrough) and the gateway, in rotating order per round, the same
closed loop of `streams` clients (aiohttp, in this process) through each for `duration_s`; each figure is the median
over rounds.
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

from .relay import NAME as RELAY
from .relay import answer, lifespan, python_relay, read_body

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
    asked = orjson.loads(await read_body(receive))
    tokens = int(asked.get("max_tokens") or os.environ.get(TOKENS_ENV, "64"))
    gap = float(os.environ.get(GAP_ENV, "0.004"))
    if not asked.get("stream"):  # the gateway's readiness canary
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


async def _load(url: str, streams: int, tokens: int, seconds: float, tally: list[int] | None = None) -> list[int]:
    """`streams` clients, each streaming completions of `tokens` back to back for `seconds`: [token events received,
    streams answered whole, streams failed], counted in `tally` as they come when one is given."""
    import aiohttp

    tally = tally if tally is not None else [0, 0, 0]
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client() -> None:
            while time.monotonic() < deadline:
                async with session.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "stream": True,
                                                                      "max_tokens": tokens}) as response:
                    body = await response.read()
                whole = response.status == 200 and body.endswith(b"data: [DONE]\n\n")
                tally[0] += body.count(b'"choices":[{')
                tally[1 if whole else 2] += 1

        await asyncio.gather(*(client() for _ in range(streams)))
    return tally


def split(runs: list[tuple[float, int, int]]) -> tuple[float, float]:
    """A path's runs (CPU-us, requests, tokens) fitted by least squares to CPU = a x requests + b x tokens: (a, b), its
    CPU-us a request and a token. Needs runs of at least two stream lengths."""
    import numpy as np

    cpu, counts = np.array([r[0] for r in runs]), np.array([[r[1], r[2]] for r in runs], dtype=float)
    (per_request, per_token), *_ = np.linalg.lstsq(counts, cpu, rcond=None)
    return round(float(per_request), 1), round(float(per_token), 2)


def run(out: Path, *, rounds: int = 5, streams: int = 16, tokens: int = 64, short: int = 8, gap_s: float = 0.004,
        duration_s: float = 8.0, profile_s: float = 20.0, progress=print) -> dict:
    """Each front end's CPU-us per token over the rounds, the gateway's over the relay's, and each one's cost split
    into a part per request and a part per token (its runs at `short` and `tokens` a stream)."""
    from serve.launcher import ServerProcess, free_port
    from serve.stack import start_gateway

    from .profile import cpu_seconds, system_calls
    from .proxy import plain_proxy

    (out / "gateway").mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, TOKENS_ENV: str(tokens), GAP_ENV: str(gap_s)}
    progress(f"a synthetic engine (streams of {short} and {tokens} token events {gap_s * 1e3:g} ms apart) behind each "
             "front end")
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
        fitted: dict[str, list[tuple[float, int, int]]] = {name: [] for name in names}
        failed = 0
        for r in range(rounds):
            for length in (tokens, short):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    target, pid = paths[name]
                    before, made = cpu_seconds(pid), system_calls(pid)
                    received, answered, lost = asyncio.run(_load(target, streams, length, duration_s))
                    spent = (cpu_seconds(pid) - before) * 1e6
                    fitted[name].append((spent, answered + lost, received))
                    failed += lost
                    if length == tokens:
                        figures[name].append(spent / max(received, 1))
                        calls[name].append(tuple((after - was) / max(received, 1)
                                                 for after, was in zip(system_calls(pid), made)))
                    progress(f"synthetic engine, round {r + 1}/{rounds}, {length} tokens a stream, {name}: "
                             f"{spent / max(received, 1):.1f} CPU-us a token")
        profiled = {}
        if profile_s:
            progress(f"profiling the Python relay and the gateway on streams of {short} and {tokens} for {profile_s:g} s "
                     "each (py-spy)")
            try:
                profiled = {name: [_profile(*paths[name], streams, length, profile_s,
                                            out / f"{name.replace(' ', '-')}-{length}.raw") for length in (short, tokens)]
                            for name in (RELAY, "gateway")}
            except RuntimeError as exc:  # no py-spy, or no ptrace here: the page says so, the figures stand
                profiled = {"error": str(exc)}
    medians = {name: round(statistics.median(values), 2) for name, values in figures.items()}
    parts = {name: dict(zip(("per_request_us", "per_token_us"), split(runs))) for name, runs in fitted.items()}
    return {"streams": streams, "tokens": tokens, "short": short, "gap_s": gap_s, "duration_s": duration_s,
            "rounds": rounds, "cpu_us_per_token": medians, "runs": figures, "fitted_runs": fitted, "failed": failed,
            "calls_per_token": {name: [round(statistics.median(c[i] for c in made), 3) for i in (0, 1)]
                                for name, made in calls.items()},
            "split": parts, "gateway_over_relay": round(medians["gateway"] / medians[RELAY], 3),
            "gateway_added_us": round(medians["gateway"] - medians[RELAY], 2),
            **({"profile": profiled} if profiled else {})}


def _profile(url: str, pid: int, streams: int, tokens: int, seconds: float, raw: Path) -> dict:
    """The front end at `pid` under the same closed loop of streams of `tokens`, sampled by py-spy for `seconds` (the
    load started before and ended after the sampling): its parts' shares, and its CPU-us a request over that window."""
    from . import profile

    async def measured() -> tuple[int, float]:
        tally = [0, 0, 0]
        task = asyncio.create_task(_load(url, streams, tokens, seconds + 4, tally))
        await asyncio.sleep(2)  # streams under way
        before, answered = profile.cpu_seconds(pid), tally[1]
        with profile.recording(pid, seconds, raw):
            await asyncio.sleep(seconds)
        spent, answered = profile.cpu_seconds(pid) - before, tally[1] - answered
        await task
        return answered, spent

    answered, spent = asyncio.run(measured())
    with open(raw) as stacks:
        summary = profile.summarize(stacks)
    return {"tokens": tokens, "seconds": seconds, "requests": answered,
            "cpu_us_per_request": round(spent * 1e6 / max(answered, 1), 1), **summary}


def markdown(result: dict) -> list[str]:
    cost = result["cpu_us_per_token"]
    split_ = result.get("split", {})
    lines = [f"Against a synthetic engine (bench/stream_cost.py: {result['tokens']} token events "
             f"{result['gap_s'] * 1e3:g} ms apart, {result['streams']} streams, {result['duration_s']:g} s a path, "
             f"median of {result['rounds']} rotating rounds; {result['failed']} streams failed), each front end's own "
             "CPU per streamed token, with no engine beside it on the cores:", "",
             "| path | CPU-us a token | read() / write() calls a token (/proc/PID/io: nginx's recv() is not one) |"
             + (" fit: CPU-us a request | fit: CPU-us a token |" if split_ else ""),
             "|---|---|---|" + ("---|---|" if split_ else ""),
             *(f"| {name} | {value} | {' / '.join(map(str, result.get('calls_per_token', {}).get(name, ['–'])))} |"
               + (f" {split_[name]['per_request_us']} | {split_[name]['per_token_us']} |" if split_ else "")
               for name, value in cost.items()), "",
             f"The gateway's code adds {result['gateway_added_us']} us a token to the Python relay's "
             f"({result['gateway_over_relay']}x its CPU): what a change to the gateway can win on a stream."]
    if split_:
        lines += ["", *_split_lines(result)]
    profiled = result.get("profile", {})
    if "error" in profiled:
        lines += ["", f"The relay and the gateway were not profiled: {profiled['error']}."]
    elif profiled:
        lines += ["", *_profile_lines(profiled)]
    return lines


def _split_lines(result: dict) -> list[str]:
    """What the fit says of the gateway's excess over the relay at the long length: per request, over a stream's
    tokens, and per token."""
    gateway, relay, tokens = result["split"]["gateway"], result["split"][RELAY], result["tokens"]
    per_request = gateway["per_request_us"] - relay["per_request_us"]
    per_token = gateway["per_token_us"] - relay["per_token_us"]
    return [f"The fit (CPU = a x requests + b x tokens over each path's runs at {result['short']} and {tokens} tokens a "
            f"stream) splits each path's cost in two. The gateway spends {per_request:.0f} us a request more than the "
            f"relay, {per_request / tokens:.1f} us a token over a stream of {tokens}, and {per_token:.1f} us more on "
            "each token it relays."]


def profile_split(short: dict, long: dict) -> dict[str, tuple[float, float]]:
    """Each part's CPU-us a request and a token, from a front end's profiles at two stream lengths (`short` and `long`,
    each with its `tokens`, its CPU-us a request and its parts' shares): a part's CPU-us a request at each length
    (its share of the whole), the line through the two."""
    def us(profile: dict, part: str) -> float:
        return profile["parts"].get(part, 0.0) * profile["cpu_us_per_request"] / 100

    split_ = {}
    for part in set(short["parts"]) | set(long["parts"]):
        per_token = (us(long, part) - us(short, part)) / (long["tokens"] - short["tokens"])
        split_[part] = (us(short, part) - per_token * short["tokens"], per_token)
    return split_


def _profile_lines(profiled: dict) -> list[str]:
    """The relay's and the gateway's parts, each split into CPU-us a request and a token, side by side, the parts where
    the gateway spends the most more first."""
    (relay_short, relay_long), (short, long) = profiled[RELAY], profiled["gateway"]
    relay, gateway = profile_split(relay_short, relay_long), profile_split(short, long)
    none = (0.0, 0.0)
    excess = lambda part: tuple(g - r for g, r in zip(gateway.get(part, none), relay.get(part, none)))  # noqa: E731
    tokens = long["tokens"]
    parts = sorted(set(relay) | set(gateway), key=lambda p: (-(excess(p)[0] / tokens + excess(p)[1]), p))
    row = lambda p, r, g: (f"| {p} | {r[0]:.0f} | {g[0]:.0f} | {g[0] - r[0]:+.0f} | {r[1]:.2f} | {g[1]:.2f} | "  # noqa: E731
                           f"{g[1] - r[1]:+.2f} |")
    whole = lambda side: tuple(map(sum, zip(*side.values())))  # noqa: E731
    samples = sum(p["samples"] for p in (relay_short, relay_long, short, long))
    return [f"Where each one's CPU goes, a request and a token (py-spy on streams of {short['tokens']} and {tokens} "
            f"tokens, {samples} samples in all; each part's share of a profile's CPU-us a request, the line through "
            "the two lengths; a sample is charged to the code its innermost frame is in):", "",
            "| part | relay, CPU-us a request | gateway | gateway - relay | relay, CPU-us a token | gateway | "
            "gateway - relay |", "|---|---|---|---|---|---|---|",
            *(row(p, relay.get(p, none), gateway.get(p, none)) for p in parts),
            row("all", whole(relay), whole(gateway)), "",
            f"The gateway's innermost functions on streams of {tokens}:", "", "| function | share |", "|---|---|",
            *(f"| `{f}` | {pct} % |" for f, pct in long["top"])]

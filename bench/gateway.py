"""`rtxserve bench gateway`: benchmark B1 (shared BENCH.md), what the gateway costs.

The fixture classifier runs in the real tritonserver. The same closed-loop client (asyncio + httpx,
`concurrency` requests in flight, no wait) calls it directly (Triton's own HTTP `POST /v2/models/NAME/infer`),
through a plain reverse proxy (nginx, bench/proxy.py: the floor) and through the gateway (`POST /v1/classify`),
interleaved in rotating order over several rounds; each figure is the median over rounds. Percentiles come
from every raw sample. The gateway's and the proxy's CPU time (their processes, from the kernel's accounting)
divided by the requests they served gives CPU-ms per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil

from core.machine import machine
from core.metric_names import OVERHEAD_HEADER

from . import stream_cost
from . import streams as b1s
from .profile import cpu_seconds, run_queue_seconds
from .proxy import nginx_version, path_table, plain_proxy
from .record import Benchmark, Files, Progress
from .relay import NAME as RELAY
from .relay import python_relay

log = logging.getLogger("rtxserve.bench")
MODEL = "bench_clf"
TEXT = "the package arrived on tuesday and it works perfectly"
PERCENTILES = (50, 90, 99, 99.9)
PLOT = "b1.png"
PROFILE_PLOT = "b1-profile.png"
FILES = Files("bench-gateway.json", "bench-gateway.md", plots=(PLOT, PROFILE_PLOT, *map(b1s.plot_name, b1s.LAYOUTS)))
# issue 53's targets at the highest concurrency, against nginx on the same box: (figure, op, value)
TARGETS = (("qps_vs_proxy", ">=", 0.95), ("p50_added_ms", "<=", 1.0), ("cpu_ms_per_request", "<=", 0.3))


async def closed_loop(request, concurrency: int, duration_s: float) -> tuple[list[float], int, float]:
    """`concurrency` loops sending `request()` back to back for `duration_s`: latencies (ms), errors, seconds."""
    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + duration_s

    async def loop():
        nonlocal errors
        while time.perf_counter() < end:
            start = time.perf_counter()
            try:
                ok = await request()
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append((time.perf_counter() - start) * 1000)
            else:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - started


def latency_summary(latencies: list[float], errors: int, seconds: float) -> dict:
    """Percentiles (ms), QPS, requests and errors of one closed-loop run, as the benchmarks record them."""
    values = np.percentile(latencies, PERCENTILES) if latencies else [float("nan")] * len(PERCENTILES)
    return {**{f"p{p:g}_ms": round(float(v), 3) for p, v in zip(PERCENTILES, values)},
            "qps": round(len(latencies) / seconds, 1), "requests": len(latencies), "errors": errors}


def _classify(client: httpx.AsyncClient, url: str, overheads: list[float] | None = None):
    """One classify request through the gateway at `url`, as a closed loop sends it: whether it was answered. With
    `overheads`, each answer's own account of the gateway's time (its x-rtxserve-overhead-ms: from the moment its app
    had the request to its answer's start, less the backend's time) goes there."""
    async def request() -> bool:
        response = await client.post(f"{url}/v1/classify", json={"model": MODEL, "input": TEXT})
        if overheads is not None and OVERHEAD_HEADER in response.headers:
            overheads.append(float(response.headers[OVERHEAD_HEADER]))
        return response.status_code == 200
    return request


async def _profile(url: str, pid: int, concurrency: int, seconds: float, out: Path) -> dict:
    """The gateway under B1's closed loop at `concurrency`, sampled by py-spy for `seconds` (bench/profile.py): where
    its CPU goes. A run of its own after the measured rounds: the sampler costs the process a little."""
    from . import profile

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        request = _classify(client, url)
        await closed_loop(request, concurrency, 2.0)
        raw = out / "b1-profile.raw"
        with profile.recording(pid, seconds, raw):
            latencies, errors, _ = await closed_loop(request, concurrency, seconds)
    with open(raw) as stacks:
        return {"concurrency": concurrency, "seconds": seconds, "requests": len(latencies), "errors": errors,
                **profile.summarize(stacks)}


def _idle_pct(before, after) -> float:
    """The share of the box's CPU time that went unused between two psutil.cpu_times(): where a closed loop's QPS is
    lost to latency rather than to CPU."""
    total = sum(after) - sum(before)
    return round(100 * (after.idle + after.iowait - before.idle - before.iowait) / total, 1) if total > 0 else 0.0


async def _measure(urls: dict[str, str], pids: dict[str, int], *, rounds: int, duration_s: float, concurrency: int,
                   progress) -> dict:
    """`urls`: direct (Triton's HTTP), proxy, the Python relay and the gateway(s); `pids`: the processes whose CPU is
    counted per request."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        direct_body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [TEXT]}]}

        def triton(url: str):
            async def request() -> bool:
                return (await client.post(f"{url}/v2/models/{MODEL}/infer", json=direct_body)).status_code == 200
            return request

        overheads: list[float] = []
        targets = {"direct": triton(urls["direct"]), "proxy": triton(urls["proxy"]),
                   RELAY: _classify(client, urls[RELAY]), "gateway": _classify(client, urls["gateway"], overheads),
                   **({"gateway traced": _classify(client, urls["gateway traced"])} if "gateway traced" in urls else {})}
        for name, request in targets.items():  # warm up every path (connections, Triton instances)
            latencies, errors, _ = await closed_loop(request, concurrency, 2.0)
            if not latencies:
                raise RuntimeError(f"B1: {name} answered none of {errors} requests (its log says why)")
        per_round: dict[str, list[dict]] = {name: [] for name in targets}
        samples: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:  # each path first in turn
                cpu_before = cpu_seconds(pids[name]) if name in pids else 0.0
                queued_before = run_queue_seconds(pids[name]) if name in pids else 0.0
                overheads.clear()
                box_before = psutil.cpu_times()
                latencies, errors, seconds = await closed_loop(targets[name], concurrency, duration_s)
                summary = latency_summary(latencies, errors, seconds)
                summary["box_idle_pct"] = _idle_pct(box_before, psutil.cpu_times())
                if name in pids:
                    served = max(1, len(latencies) + errors)
                    summary["cpu_ms_per_request"] = round((cpu_seconds(pids[name]) - cpu_before) * 1000 / served, 3)
                    # the time its threads were runnable but waited for a core (the kernel's schedstat)
                    summary["run_queue_ms_per_request"] = round(
                        (run_queue_seconds(pids[name]) - queued_before) * 1000 / served, 3)
                if name == "gateway" and overheads:
                    summary["own_ms_p50"] = round(float(np.percentile(overheads, 50)), 3)
                per_round[name].append(summary)
                samples[name] += latencies
                progress(f"round {i + 1}/{rounds}, {concurrency} in flight, {name}: P50 {summary['p50_ms']} ms, "
                         f"P99 {summary['p99_ms']} ms, {summary['qps']} QPS")
    medians = {name: {k: round(statistics.median(r[k] for r in rounds_), 3) for k in rounds_[0]}
               for name, rounds_ in per_round.items()}
    return {"concurrency": concurrency, "medians": medians, "rounds": per_round, "samples": samples}


def export_classifier(work: Path, progress) -> Path:
    """The fixture classifier (2 instances) written and exported under `work`: its Triton model repository."""
    from export.encoders.encoder import export_text_classification
    from export.triton.entry import EntryOptions
    from fixture_models.text import write_text_classifier

    progress("writing and exporting the fixture classifier")
    export_text_classification(write_text_classifier(work / "ckpt"), EntryOptions(name=MODEL, instances=2),
                               work / "repo")
    return work / "repo"


@contextlib.contextmanager
def classifier_triton(progress) -> Iterator[tuple[str, str]]:
    """The fixture classifier (2 instances) in a real tritonserver: (its gRPC address, its HTTP URL); stopped on
    exit."""
    from serve.stack import start_triton

    with tempfile.TemporaryDirectory(prefix="rtxserve-bench-") as tmp:
        work = Path(tmp)
        triton, opts = start_triton(export_classifier(work, progress), work / "logs")
        try:
            yield f"127.0.0.1:{opts.grpc_port}", f"http://127.0.0.1:{opts.http_port}"
        finally:
            triton.stop()


@contextlib.contextmanager
def classifier_stack(workers: int, progress, gateway_env: dict[str, str] | None = None) -> Iterator[tuple[str, str, int]]:
    """The fixture classifier's tritonserver behind a real gateway (with `gateway_env`'s settings): (gateway URL,
    Triton's HTTP URL, the gateway's pid); both stopped on exit."""
    from serve.stack import start_gateway

    with classifier_triton(progress) as (grpc, http), tempfile.TemporaryDirectory() as logs:
        gateway, url = start_gateway(grpc, Path(logs), workers=workers, extra_env=gateway_env)
        try:
            yield url, http, gateway.process.pid
        finally:
            gateway.stop()


def run(out: Path, *, rounds: int = 5, duration_s: float = 8.0, concurrency: tuple[int, ...] = (1, 8), workers: int = 1,
        streams: tuple[int, ...] = (4, 16), stream_prompts: int = 300, stream_layouts: tuple[str, ...] | None = None,
        profile_s: float = 10.0, progress=log.info) -> dict:
    """B1 (classify) and, unless `streams` is empty, B1s (bench/streams.py: each of vLLM's `stream_layouts`, then
    bench/stream_cost.py: a synthetic engine at the highest level)."""
    from serve.stack import start_gateway

    out.mkdir(parents=True, exist_ok=True)
    with classifier_triton(progress) as (grpc, triton_http), tempfile.TemporaryDirectory() as tmp, \
            plain_proxy(triton_http.removeprefix("http://"), Path(tmp), "/v2/health/ready") as (proxy, proxy_pid), \
            python_relay(grpc, Path(tmp)) as (relay, relay_pid), contextlib.ExitStack() as gateways:
        urls, pids = {"direct": triton_http, "proxy": proxy, RELAY: relay}, {"proxy": proxy_pid, RELAY: relay_pid}
        # the gateway, and beside it one that records its traffic (trace_dir): what the trace costs, side by side
        for name, env in (("gateway", {}), ("gateway traced", {"RTXSERVE_TRACE_DIR": str(Path(tmp) / "trace")})):
            gateway, urls[name] = start_gateway(grpc, Path(tmp) / name.replace(" ", "-"), workers=workers,
                                                extra_env=env)
            gateways.callback(gateway.stop)
            pids[name] = gateway.process.pid
        levels = [asyncio.run(_measure(urls, pids, rounds=rounds, duration_s=duration_s, concurrency=c,
                                       progress=progress))
                  for c in concurrency]
        profiled = {}
        if profile_s:
            progress(f"profiling the gateway at {max(concurrency)} in flight for {profile_s:g} s (py-spy)")
            try:
                profiled = asyncio.run(_profile(urls["gateway"], pids["gateway"], max(concurrency), profile_s, out))
            except RuntimeError as exc:  # no py-spy, or no ptrace here: the page says so, the figures stand
                profiled = {"error": str(exc)}
    result = {"bench": "B1", "model": "fixture BERT classifier (2 instances, python backend + ONNX Runtime)",
              "rounds": rounds, "duration_s": duration_s, "gateway_workers": workers, "cpu": machine(),
              "versions": {"tritonserver": "2.51 (nvidia-pytriton 0.7.0)", "fastapi": _version("fastapi"),
                           "uvicorn": _version("uvicorn"), "tritonclient": _version("tritonclient"),
                           "nginx": nginx_version()},
              "levels": [{k: v for k, v in level.items() if k != "samples"} for level in levels]}
    if profiled:
        result["profile"] = profiled
    if streams:
        result["streams"] = [b1s.run(out / f"streams-{layout}", rounds=rounds, concurrency=streams,
                                     prompts=stream_prompts, layout=layout, profile_s=profile_s, progress=progress)
                             for layout in stream_layouts or b1s.default_layouts()]
        for layouts in result["streams"]:
            b1s.plot(layouts, out / b1s.plot_name(layouts["layout"]))
        result["stream_cost"] = stream_cost.run(out / "streams-synthetic", rounds=rounds, streams=max(streams),
                                                duration_s=duration_s, progress=progress)
    for level in result["levels"]:
        m = level["medians"]
        level["qps_vs_proxy"] = round(m["gateway"]["qps"] / m["proxy"]["qps"], 3)
        level["cpu_ms_per_request"] = m["gateway"]["cpu_ms_per_request"]
        level["p99_ratio"] = round(m["gateway"]["p99_ms"] / m["direct"]["p99_ms"], 3)
        level["qps_ratio"] = round(m["gateway"]["qps"] / m["direct"]["qps"], 3)
        level["p50_added_ms"] = round(m["gateway"]["p50_ms"] - m["direct"]["p50_ms"], 3)
        level["proxy_p50_added_ms"] = round(m["proxy"]["p50_ms"] - m["direct"]["p50_ms"], 3)
        # the same figures for the Python relay: what any front door in Python reaches on this box
        level["relay"] = {"qps_vs_proxy": round(m[RELAY]["qps"] / m["proxy"]["qps"], 3),
                          "p50_added_ms": round(m[RELAY]["p50_ms"] - m["direct"]["p50_ms"], 3),
                          "cpu_ms_per_request": m[RELAY]["cpu_ms_per_request"]}
        level["qps_vs_relay"] = round(m["gateway"]["qps"] / m[RELAY]["qps"], 3)
        level["trace_cpu_ms_added"] = round(m["gateway traced"]["cpu_ms_per_request"] - m["gateway"]["cpu_ms_per_request"], 3)
        level["trace_qps_ratio"] = round(m["gateway traced"]["qps"] / m["gateway"]["qps"], 3)
        level["trace_p99_ratio"] = round(m["gateway traced"]["p99_ms"] / m["gateway"]["p99_ms"], 3)
    result["verdict"] = {key: b1s.met(result["levels"][-1][key], op, value) for key, op, value in TARGETS}
    (out / FILES.json).write_text(json.dumps(result, indent=2))
    (out / FILES.page).write_text(markdown(result))
    _plot(levels, out / PLOT)
    if "parts" in profiled:
        from . import profile

        profile.plot(profiled, out / PROFILE_PLOT, f"B1: where the gateway's CPU goes at {profiled['concurrency']} in "
                     "flight (py-spy, self time)")
    return result


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def markdown(result: dict) -> str:
    lines = [f"# B1: gateway overhead ({result['model']}, {result['gateway_workers']} gateway worker(s), "
             f"median of {result['rounds']} interleaved rounds x {result['duration_s']:g} s; CPU: {result['cpu']})", "",
             f"![latency distributions direct, through nginx and through the gateway]({PLOT})", "",
             *path_table(result["levels"], "in flight", [("P50 ms", "p50_ms"), ("P90 ms", "p90_ms"), ("P99 ms", "p99_ms"),
                                                         ("P99.9 ms", "p99.9_ms"), ("QPS", "qps"), ("errors", "errors"),
                                                         ("CPU-ms / request", "cpu_ms_per_request"),
                                                         ("ms / request waiting for a core", "run_queue_ms_per_request"),
                                                         ("own time P50 ms", "own_ms_p50"),
                                                         ("box CPU idle %", "box_idle_pct")])]
    lines += ["", "| in flight | P99 gateway / direct (target <= 1.25 at 8) | QPS gateway / direct (target >= 0.85 at 8) | "
              "P50 added ms, gateway / proxy | CPU-ms / request, gateway (target <= 0.6 at 8) / proxy |",
              "|---|---|---|---|---|"]
    for level in result["levels"]:
        m = level["medians"]
        lines.append(f"| {level['concurrency']} | {level['p99_ratio']} | {level['qps_ratio']} | "
                     f"{level['p50_added_ms']} / {level['proxy_p50_added_ms']} | "
                     f"{m['gateway']['cpu_ms_per_request']} / {m['proxy']['cpu_ms_per_request']} |")
    lines += ["", "Where a request's added time goes: a front end's CPU-ms, and the milliseconds its threads were runnable "
              "but waited for a core (the kernel's schedstat, over the run, per request); the gateway's own time is its "
              "x-rtxserve-overhead-ms (from the moment its app has the request to its answer's start, less the backend "
              "call): what is left of the P50 added is the sockets, the HTTP server and the event loop's queue."]
    if "verdict" in result:
        top = result["levels"][-1]
        lines += b1s.verdict_table(f"{top['concurrency']} in flight; proxy: nginx on the same box", TARGETS, top)
        if "relay" in top:
            held = ", ".join(f"{level['qps_vs_relay']}x at {level['concurrency']}" for level in result["levels"])
            lines += ["", "The Python relay (bench/relay.py) is the least a front door in Python does: uvicorn as the "
                      "gateway runs it, the body read as JSON, the gateway's one gRPC call to Triton, a JSON answer; no "
                      "keys, checks, metrics or routing. Where it misses a target, no change to the gateway's own code "
                      f"meets it on this box: only a front door outside Python would. The gateway's QPS / the relay's: "
                      f"{held} in flight."]
    if all("trace_qps_ratio" in level for level in result["levels"]):
        lines += ["", "The trace (trace_dir on, a gateway beside the other): what recording every request costs.", "",
                  "| in flight | QPS traced / untraced | P99 traced / untraced | CPU-ms / request added |",
                  "|---|---|---|---|"]
        lines += [f"| {level['concurrency']} | {level['trace_qps_ratio']} | {level.get('trace_p99_ratio', '–')} | "
                  f"{level['trace_cpu_ms_added']} |" for level in result["levels"]]
    profiled = result.get("profile", {})
    if "parts" in profiled:
        from . import profile

        level = next(lv for lv in result["levels"] if lv["concurrency"] == profiled["concurrency"])
        lines += ["", f"![where the gateway's CPU goes]({PROFILE_PLOT})", "",
                  *profile.markdown(profiled, f"{profiled['concurrency']} in flight, {profiled['seconds']:g} s, "
                                    f"{profiled['requests']} requests", level["medians"]["gateway"]["cpu_ms_per_request"])]
    elif profiled:
        lines += ["", f"The gateway was not profiled: {profiled['error']}"]
    for layout in result.get("streams", ()):
        lines += ["", b1s.markdown(layout)]
    if "stream_cost" in result:
        lines += ["", *stream_cost.markdown(result["stream_cost"])]
    return "\n".join(lines) + "\n"


def _plot(levels: list[dict], path: Path) -> None:
    from loadtest.report.plots import latency_cdf, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(levels), figsize=(6 * len(levels), 4.2), squeeze=False)
    for ax, level in zip(axes[0], levels):
        latency_cdf(ax, [(f"{name} (P99 {level['medians'][name]['p99_ms']:.1f} ms, {level['medians'][name]['qps']:.0f} QPS)",
                          level["samples"][name], colour)
                         for name, colour in zip(level["medians"], ("tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:red"))])
        ax.set_title(f"B1, {level['concurrency']} in flight: latency distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- `rtxserve bench gateway` ---------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each figure is their median (rounds on a "
                        "shared 2-core box spread by 15 %%: with 3, the trace's cost read 0.89x QPS, with 6, 1.04x)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per path, level and round")
    parser.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated levels")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument("--streams", default="4,16",
                        help="B1s: concurrent streams per level, comma-separated ('' skips it); the highest is also "
                             "run against a synthetic engine (bench/stream_cost.py: each front end's CPU per token)")
    parser.add_argument("--stream-prompts", type=int, default=300, help="B1s: requests per vllm bench serve run")
    parser.add_argument("--stream-layouts", default=",".join(b1s.default_layouts()),
                        help="B1s: vLLM's layouts, comma-separated: 'core' (the model in the engine core: two "
                             "processes) and 'three' (vLLM's own default on a CPU); default: 'core', and the layout "
                             "`serve up` runs on this box where that is another (bench/streams.py)")
    parser.add_argument("--profile-seconds", type=float, default=10.0,
                        help="after the rounds, where the gateway's CPU goes at the highest --concurrency, sampled by "
                             "py-spy for this long (0 skips it)")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-gateway-<time>)")


def _levels(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """--concurrency's levels and --streams' (which may be empty); ValueError where one is not numbers."""
    return (tuple(int(c) for c in args.concurrency.split(",")),
            tuple(int(c) for c in args.streams.split(",") if c.strip()))


def check_arguments(args: argparse.Namespace) -> str | None:
    try:
        levels, streams = _levels(args)
    except ValueError:
        return "--concurrency and --streams: use numbers separated by commas"
    unknown = {v.strip() for v in args.stream_layouts.split(",") if v.strip()} - set(b1s.LAYOUTS)
    if unknown:
        return f"--stream-layouts: {', '.join(sorted(unknown))} is not one of {', '.join(b1s.LAYOUTS)}"
    if args.rounds < 1 or args.duration <= 0 or min(levels) < 1 or min(streams, default=1) < 1 or args.workers < 1 \
            or args.stream_prompts < 1 or args.profile_seconds < 0:
        return ("need --rounds >= 1, --duration > 0, --workers >= 1, --stream-prompts >= 1, --profile-seconds >= 0 "
                "and levels >= 1")
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    levels, streams = _levels(args)
    return run(out, rounds=args.rounds, duration_s=args.duration, concurrency=levels, workers=args.workers,
               streams=streams, stream_prompts=args.stream_prompts,
               stream_layouts=tuple(v.strip() for v in args.stream_layouts.split(",") if v.strip()),
               profile_s=args.profile_seconds, progress=progress)


BENCHMARK = Benchmark(
    name="gateway", id="B1", title="gateway overhead",
    help="B1: the gateway's overhead and CPU-ms per request vs calling Triton directly",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

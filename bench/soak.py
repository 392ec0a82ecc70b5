"""`rtxserve bench soak`: R18 (shared RELIABILITY.md), a bounded soak of the gateway.

The fixture classifier runs in the real tritonserver behind the real gateway. A closed-loop client keeps
`concurrency` requests in flight for `duration_s`; one request in twenty is malformed (a 422), one in
twenty sends its own x-request-id, so error and header paths run as long as the happy one. After each
window the gateway's processes are sampled: resident memory, open file descriptors, CPU. The first
`warmup` fraction of the run is left out of the verdict (allocators and caches fill then):

- memory is flat when the fitted RSS slope, over the measured span, grows it by at most 2 %;
- descriptors are flat when none are left open beyond the first measured window's count (+2);
- P99 drift: median window P99 of the last third over that of the first third, at most +10 % (faster is fine).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from .gateway import MODEL, TEXT, classifier_stack
from .record import Benchmark, Files, Progress

log = logging.getLogger("rtxserve.bench")
RSS_GROWTH_MAX = 0.02
FD_SLACK = 2
P99_DRIFT_MAX = 0.10
PLOT = "soak.png"
FILES = Files("soak.json", "soak.md", plots=(PLOT,))


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _sample(pid: int) -> dict:
    rss = fds = 0
    cpu = 0.0
    for p in _tree(pid):
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                fds += p.num_fds()
                cpu += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return {"rss_mb": round(rss / 2**20, 2), "fds": fds, "cpu_s": round(cpu, 3)}


async def _window(client: httpx.AsyncClient, url: str, counter, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    codes: dict[str, int] = {}
    end = time.perf_counter() + seconds

    async def loop():
        while time.perf_counter() < end:
            n = next(counter)
            body = {"model": MODEL, "input": TEXT} if n % 20 else {"model": MODEL, "input": []}  # 1 in 20: 422
            headers = {"x-request-id": f"soak-{n}"} if n % 20 == 10 else None
            start = time.perf_counter()
            try:
                r = await client.post(f"{url}/v1/classify", json=body, headers=headers)
                code = str(r.status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            if code == "200":
                latencies.append((time.perf_counter() - start) * 1000)
            codes[code] = codes.get(code, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"p50_ms": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
            "p99_ms": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
            "qps": round(sum(codes.values()) / elapsed, 1), "codes": codes}


async def _soak(url: str, pid: int, *, duration_s: float, window_s: float, concurrency: int, progress) -> list[dict]:
    windows = []
    counter = itertools.count()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        started = time.monotonic()
        while time.monotonic() - started < duration_s:
            w = await _window(client, url, counter, concurrency, min(window_s, duration_s - (time.monotonic() - started)))
            w |= {"t_s": round(time.monotonic() - started, 1), **_sample(pid)}
            windows.append(w)
            progress(f"soak {w['t_s']:.0f}/{duration_s:.0f} s: P99 {w['p99_ms']} ms, {w['qps']} req/s, "
                     f"RSS {w['rss_mb']} MB, {w['fds']} fds, answers {w['codes']}")
    return windows


def verdict(windows: list[dict], warmup: float = 0.2) -> dict:
    """R18's three checks on the windows after the warm-up; each figure and whether it passes."""
    measured = windows[int(len(windows) * warmup):]
    if len(measured) < 3:
        raise ValueError(f"{len(measured)} windows after the warm-up: run longer or use shorter windows")
    t = np.array([w["t_s"] for w in measured]) / 60
    rss = np.array([w["rss_mb"] for w in measured])
    slope = float(np.polyfit(t, rss, 1)[0])  # MB per minute, least squares
    growth = float(slope * (t[-1] - t[0]) / rss.mean())
    fds = [w["fds"] for w in measured]
    third = max(1, len(measured) // 3)
    p99_first = statistics.median(w["p99_ms"] for w in measured[:third])
    p99_last = statistics.median(w["p99_ms"] for w in measured[-third:])
    drift = p99_last / p99_first - 1
    codes: dict[str, int] = {}
    for w in windows:
        for code, n in w["codes"].items():
            codes[code] = codes.get(code, 0) + n
    unexpected = {c: n for c, n in codes.items() if c not in ("200", "422")}
    return {
        "rss_slope_mb_per_min": round(slope, 3), "rss_growth_over_span": round(growth, 4),
        "rss_flat": bool(growth <= RSS_GROWTH_MAX),
        "fds_first": fds[0], "fds_max": max(fds), "fds_flat": max(fds) <= fds[0] + FD_SLACK,
        "p99_first_ms": round(p99_first, 3), "p99_last_ms": round(p99_last, 3), "p99_drift": round(drift, 4),
        "p99_drift_ok": bool(drift <= P99_DRIFT_MAX),
        "answers": codes, "unexpected_answers": unexpected,
        "passed": bool(growth <= RSS_GROWTH_MAX and max(fds) <= fds[0] + FD_SLACK and drift <= P99_DRIFT_MAX
                       and not unexpected),
    }


def run(out: Path, *, duration_s: float = 600, window_s: float = 10, concurrency: int = 8, workers: int = 1,
        progress=log.info) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with classifier_stack(workers, progress) as (url, _, pid):
        windows = asyncio.run(_soak(url, pid, duration_s=duration_s, window_s=window_s, concurrency=concurrency,
                                    progress=progress))
    result = {"bench": "R18", "model": "fixture BERT classifier (2 instances)", "duration_s": duration_s,
              "window_s": window_s, "concurrency": concurrency, "gateway_workers": workers,
              "verdict": verdict(windows), "windows": windows}
    (out / FILES.json).write_text(json.dumps(result, indent=2))
    (out / FILES.page).write_text(markdown(result))
    plot(result, out / PLOT)
    return result


def markdown(result: dict) -> str:
    v = result["verdict"]
    ok = lambda b: "met" if b else "**not met**"  # noqa: E731
    lines = [f"# R18 soak: {result['duration_s']:g} s, {result['concurrency']} in flight, "
             f"{result['gateway_workers']} gateway worker(s), {result['model']}", "",
             "| check | figure | target | |", "|---|---|---|---|",
             f"| gateway RSS | slope {v['rss_slope_mb_per_min']} MB/min, {v['rss_growth_over_span']:.2%} over the "
             f"measured span | <= {RSS_GROWTH_MAX:.0%} | {ok(v['rss_flat'])} |",
             f"| open descriptors | {v['fds_first']} first, {v['fds_max']} max | <= first + {FD_SLACK} | {ok(v['fds_flat'])} |",
             f"| P99 drift | {v['p99_first_ms']} -> {v['p99_last_ms']} ms ({v['p99_drift']:+.1%}) | at most "
             f"+{P99_DRIFT_MAX:.0%} | {ok(v['p99_drift_ok'])} |",
             f"| answers | {v['answers']} | only 200 and the malformed 422 | {ok(not v['unexpected_answers'])} |",
             "", "| t (s) | P50 ms | P99 ms | req/s | RSS MB | fds |", "|---|---|---|---|---|---|"]
    lines += [f"| {w['t_s']} | {w['p50_ms']} | {w['p99_ms']} | {w['qps']} | {w['rss_mb']} | {w['fds']} |"
              for w in result["windows"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, v = result["windows"], result["verdict"]
    t = [w["t_s"] / 60 for w in windows]
    warm = t[int(len(t) * 0.2)] if t else 0
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    series = (("rss_mb", "gateway RSS (MB)", f"slope {v['rss_slope_mb_per_min']} MB/min"),
              ("fds", "open file descriptors", f"{v['fds_first']} -> max {v['fds_max']}"),
              ("p99_ms", "P99 per window (ms)", f"drift {v['p99_drift']:+.1%}"))
    for ax, (key, label, note) in zip(axes, series):
        ax.plot(t, [w[key] for w in windows], marker=".", label=note)
        ax.axvspan(0, warm, color="grey", alpha=0.15, label="warm-up (not judged)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[1].yaxis.get_major_locator().set_params(integer=True)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(f"R18 soak, {result['concurrency']} in flight: {'passed' if v['passed'] else 'NOT passed'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- `rtxserve bench soak` ------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--window", type=float, default=10.0, help="seconds per sample")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-soak-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.duration < 3 * args.window or args.window <= 0 or args.concurrency < 1 or args.workers < 1:
        return ("need --window > 0, --duration >= 3 windows (the first 20 % is warm-up), --concurrency >= 1 "
                "and --workers >= 1")
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, duration_s=args.duration, window_s=args.window, concurrency=args.concurrency, workers=args.workers,
               progress=progress)


BENCHMARK = Benchmark(
    name="soak", id="R18", title="bounded soak of the gateway",
    help="R18: a bounded soak of the gateway (RSS slope, open descriptors, P99 drift)",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES,
    in_make_bench=False)

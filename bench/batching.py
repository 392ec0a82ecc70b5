"""`rtxserve bench batching`: benchmarks B3 (dynamic batching on / off) and B5 (2 instances / 1) of the shared
BENCH.md, on the fixture classifier in the real tritonserver behind the gateway.

Each configuration is a copy of one exported entry with its knobs set (serve/entry_config.py), served by
its own tritonserver + gateway and loaded by the same closed-loop locust run (16 users, no wait), exactly
as `rtxserve tune` measures it. The configurations run interleaved, forward then backward in alternate rounds;
each figure is the median over rounds, so a noisy neighbour hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .record import Benchmark, Files, Progress

MODEL = "bench_clf"
PLOT = "b3-b5.png"
FILES = Files("bench-batching.json", "bench-batching.md", plots=(PLOT,))
CONFIGS = {  # the knobs of each measured configuration
    "batching off": {"instances": 1, "max_batch_size": 1, "max_queue_delay_us": 0},
    "batching on": {"instances": 1, "max_batch_size": 16, "max_queue_delay_us": 2000},
    "2 instances": {"instances": 2, "max_batch_size": 1, "max_queue_delay_us": 0},
}
TARGETS = {"B3": ("batching on", "batching off", 2.0, "Triton dynamic batching on / off, throughput"),
           "B5": ("2 instances", "batching off", 1.5, "instance_group count 2 / count 1, throughput (CPU-bound model)")}


def run(out: Path, *, rounds: int = 3, duration_s: float = 12.0, users: int = 16, progress=print) -> dict:
    from export.encoders.encoder import export_text_classification
    from fixture_models.text import write_text_classifier
    from export.triton.entry import EntryOptions
    from loadtest.report.pages import versions
    from loadtest.runner import LoadSpec, scenario_options
    from rtxserve.tune import TritonTarget, evaluate

    out.mkdir(parents=True, exist_ok=True)
    repo = out / "repository"
    if not (repo / MODEL).exists():
        export_text_classification(write_text_classifier(out / "checkpoint"), EntryOptions(name=MODEL), repo)

    def spec_for(url: str, scrape: list[str]) -> LoadSpec:
        return LoadSpec(url, scenario_options(model=MODEL), users=users, duration_s=duration_s,
                        warmup_s=min(3.0, duration_s / 4), scrape=scrape)

    target = TritonTarget(repo, MODEL)

    qps: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            trial = evaluate(target, CONFIGS[name], spec_for, out / f"round-{r + 1}" / name.replace(" ", "-"),
                             lambda m: None)
            if trial.failure or trial.errors:
                raise RuntimeError(f"{name}: {trial.failure or f'{trial.errors} failed requests'}")
            qps[name].append(trial.qps)
            progress(f"  round {r + 1}/{rounds}: {name:<13} {trial.qps:7.1f} QPS (P99 {trial.p99_ms:.1f} ms)")
    medians = {name: statistics.median(v) for name, v in qps.items()}
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(),
              "settings": {"rounds": rounds, "duration_s": duration_s, "users": users, "configs": CONFIGS},
              "qps_rounds": qps, "qps_median": medians}
    for key, (a, b, target, what) in TARGETS.items():
        result[key] = {"what": what, "ratio": medians[a] / medians[b], "target": target, "a": a, "b": b}
    return FILES.save(out, result, markdown, plot)


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(result["qps_median"])
    ax.bar(names, [result["qps_median"][n] for n in names], color=["tab:gray", "tab:green", "tab:blue"], alpha=0.7)
    for i, n in enumerate(names):
        ax.scatter([i] * len(result["qps_rounds"][n]), result["qps_rounds"][n], color="black", s=12, zorder=3)
    ax.set_ylabel("QPS (bars: median; dots: rounds)")
    ax.set_title(f"B3 = {result['B3']['ratio']:.2f}x (target ≥ 2), B5 = {result['B5']['ratio']:.2f}x (target ≥ 1.5)")
    return save(fig, path, f"Triton on CPU, {result['settings']['users']} closed-loop users")


def markdown(result: dict) -> str:
    rows = "\n".join(f"| {n} | {json.dumps(CONFIGS[n])} | {m:.1f} | {', '.join(f'{q:.1f}' for q in result['qps_rounds'][n])} |"
                     for n, m in result["qps_median"].items())
    lines = ["# rtxserve bench batching (B3, B5)", "", f"![QPS per configuration]({PLOT})", "",
             "| configuration | knobs | QPS (median) | rounds |", "|---|---|---|---|", rows, ""]
    for key in ("B3", "B5"):
        b = result[key]
        lines.append(f"**{key} = {b['ratio']:.2f}x** ({b['what']}: {b['a']} / {b['b']}; target ≥ {b['target']:g}x)  ")
    return "\n".join(lines) + "\n"


# --- `rtxserve bench batching` --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of load per configuration and round")
    parser.add_argument("--users", type=int, default=16, help="closed-loop users")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-batching-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.duration <= 4 or args.users < 1:
        return "need --rounds >= 1, --duration > 4 and --users >= 1"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rounds=args.rounds, duration_s=args.duration, users=args.users, progress=progress)


BENCHMARK = Benchmark(
    name="batching", id="B3 / B5", title="Triton batching and instances",
    help="B3 (dynamic batching on / off) and B5 (2 instances / 1) on the fixture classifier",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

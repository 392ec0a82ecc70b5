"""`rtxserve bench cache`: benchmark B9 (shared BENCH.md), what Triton's response cache buys a classify workload
with repeated inputs.

The fixture classifier is exported twice into one deployment, one entry with `response_cache_mb` and one without,
and served by the real tritonserver behind the real gateway. The same closed-loop client (bench/gateway.py) sends
classify requests through the gateway where `repeats` of them (0.5 by default) are one of a few texts seen before
and the rest are new; the two entries are measured in alternating order over several rounds, each figure the
median over rounds. B9 is the ratio of their QPS (target >= 1.5), with Triton's own hit rate for the cached one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
from pathlib import Path

import httpx
import yaml

from core.machine import machine

from .gateway import closed_loop, latency_summary
from .record import Benchmark, Files, Progress

ENTRIES = {"cached": 64, "uncached": 0}  # entry name -> response_cache_mb
REPEATED = [f"the package arrived on day {i} and it works" for i in range(8)]
PLOT = "b9.png"
FILES = Files("bench-cache.json", "bench-cache.md", plots=(PLOT,))


def _texts(repeats: float, seed: int):
    """An endless supply of inputs: `repeats` of them from REPEATED, the others never seen before."""
    rng, n = random.Random(seed), 0
    while True:
        n += 1
        yield rng.choice(REPEATED) if rng.random() < repeats else f"review {seed}-{n}: {rng.random():.12f} stars"


def _hit_rate(metrics_url: str, model: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    counts = {s.name.removesuffix("_total"): s.value
              for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text)
              for s in family.samples if s.labels.get("model") == model and s.name.startswith("nv_cache_num_")}
    looked_up = counts.get("nv_cache_num_hits_per_model", 0) + counts.get("nv_cache_num_misses_per_model", 0)
    return counts.get("nv_cache_num_hits_per_model", 0) / looked_up if looked_up else None


@contextlib.contextmanager
def _stack(work: Path, progress):
    """Both entries in one tritonserver (with the cache the deployment sizes) behind the gateway: (gateway URL,
    Triton's metrics URL)."""
    from deploy.plan import plan
    from deploy.repository import assemble_repository, response_cache_args
    from deploy.spec import load_deployment
    from export.encoders.encoder import export_text_classification
    from fixture_models.text import write_text_classifier
    from export.triton.entry import EntryOptions
    from serve.stack import start_gateway, start_triton

    progress("writing and exporting the fixture classifier (twice)")
    checkpoint = write_text_classifier(work / "ckpt")
    for name in ENTRIES:
        export_text_classification(checkpoint, EntryOptions(name=name, instances=2), work / "exported")
    (work / "box.yaml").write_text(yaml.safe_dump({"name": "b9", "gpus": {"count": 0}, "models": [
        {"name": name, "kind": "encoder", "path": f"exported/{name}", "response_cache_mb": mb}
        for name, mb in ENTRIES.items()]}))
    d = load_deployment(work / "box.yaml")
    triton, opts = start_triton(assemble_repository(d, plan(d), work / "repository"), work / "logs",
                                extra_args=tuple(response_cache_args(d)))
    try:
        gateway, url = start_gateway(f"127.0.0.1:{opts.grpc_port}", work / "logs")
        try:
            yield url, f"http://127.0.0.1:{opts.metrics_port}/metrics"
        finally:
            gateway.stop()
    finally:
        triton.stop()


async def _measure(url: str, *, rounds: int, duration_s: float, concurrency: int, repeats: float, progress) -> dict:
    per_round: dict[str, list[dict]] = {name: [] for name in ENTRIES}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:
        for i in range(rounds):
            for name in (list(ENTRIES) if i % 2 == 0 else list(reversed(ENTRIES))):
                texts = _texts(repeats, seed=i)

                async def request(name=name, texts=texts) -> bool:
                    body = {"model": name, "input": next(texts)}
                    return (await client.post(f"{url}/v1/classify", json=body)).status_code == 200

                summary = latency_summary(*await closed_loop(request, concurrency, duration_s))
                per_round[name].append(summary)
                progress(f"round {i + 1}/{rounds}, {name}: {summary['qps']} QPS, P99 {summary['p99_ms']} ms")
    return {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for name, rs in per_round.items()} \
        | {"per_round": per_round}


def run(out: Path, *, rounds: int = 3, duration_s: float = 8.0, concurrency: int = 8, repeats: float = 0.5,
        progress=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rtxserve-b9-") as tmp, _stack(Path(tmp), progress) as (url, metrics):
        measured = asyncio.run(_measure(url, rounds=rounds, duration_s=duration_s, concurrency=concurrency,
                                        repeats=repeats, progress=progress))
        hit_rate = _hit_rate(metrics, "cached")
    result = {"bench": "B9", "target": 1.5, "cpu": machine(), "rounds": rounds, "duration_s": duration_s,
              "concurrency": concurrency, "repeats": repeats, "hit_rate": hit_rate, **measured,
              "qps_ratio": round(measured["cached"]["qps"] / measured["uncached"]["qps"], 3)}
    (out / FILES.json).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / PLOT)
    (out / FILES.page).write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    rows = "\n".join(f"| {name} | {result[name]['qps']} | {result[name]['p50_ms']} | {result[name]['p99_ms']} | "
                     f"{result[name]['errors']} |" for name in ENTRIES)
    hits = "–" if result["hit_rate"] is None else f"{result['hit_rate']:.0%}"
    return f"""# B9: Triton's response cache ({result['repeats']:.0%} repeated inputs, classify through the gateway)

![QPS with and without the cache, round by round]({PLOT})

Fixture classifier exported twice, one entry with `response_cache_mb`, one without, in one tritonserver behind the
gateway; {result['concurrency']} in flight, median of {result['rounds']} alternating rounds x {result['duration_s']:g} s.
CPU: {result['cpu']}.

| entry | QPS | P50 ms | P99 ms | errors |
|---|---|---|---|---|
{rows}

QPS with / without the cache: **{result['qps_ratio']}** (target >= {result['target']}); Triton's hit rate on the
cached entry over the run: {hits}, of {result['repeats']:.0%} requests that repeat an earlier input. The gateway sends
a cached model's requests one by one (a coalesced call's mix of inputs is never seen twice, and missed: 26 % hits
before), so the cached entry gives up the coalescing the uncached one keeps.
"""


def plot(result: dict, path: Path) -> Path:
    from loadtest.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, colour) in enumerate(zip(ENTRIES, ("tab:green", "tab:gray"))):
        ax.bar(i, result[name]["qps"], color=colour, alpha=0.75)
        rounds = [r["qps"] for r in result["per_round"][name]]
        ax.scatter([i] * len(rounds), rounds, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(ENTRIES)), list(ENTRIES))
    ax.set_ylabel("classify QPS through the gateway")
    ax.set_xlabel("bars: the median of the rounds; dots: each round", fontsize=8)  # a legend hid a round's dot
    return save(fig, path, f"B9: response cache, {result['repeats']:.0%} repeated inputs: "
                           f"{result['qps_ratio']}x QPS (target {result['target']}x)")


# --- `rtxserve bench cache` -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per entry and round")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--repeats", type=float, default=0.5, help="share of requests that repeat an earlier input")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-cache-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.duration <= 0 or args.concurrency < 1 or not 0 <= args.repeats <= 1:
        return "need --rounds >= 1, --duration > 0, --concurrency >= 1 and --repeats within 0..1"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rounds=args.rounds, duration_s=args.duration, concurrency=args.concurrency, repeats=args.repeats,
               progress=progress)


BENCHMARK = Benchmark(
    name="cache", id="B9", title="Triton response cache",
    help="B9: classify QPS with Triton's response cache / without, at repeated inputs",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

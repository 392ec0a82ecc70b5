"""`rtxserve bench cache`: benchmark B9 (shared BENCH.md), what an answer cache buys a classify workload with
repeated inputs.

The fixture classifier is exported three times into one deployment: one entry with the gateway's answer cache
(`response_cache_mb`), one with Triton's response cache (`triton_response_cache`; the gateway, told of no cache for
it here, sends its requests one by one, as that cache needs), one with none; all served by the real tritonserver behind the real gateway, as the deployment
configures both. The same closed-loop client (bench/gateway.py) sends classify requests through the gateway where
`repeats` of them (0.5 by default) are one of a few texts seen before and the rest are new; the entries are measured
in rotating order over several rounds, each figure the median over rounds. B9 is the ratio of the gateway-cached
entry's QPS to the uncached one's (target >= 1.5), with each cache's own hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

import httpx
import yaml

from core import metric_names
from core.machine import machine

from .gateway import closed_loop, latency_summary
from .profile import cpu_seconds
from .record import Benchmark, Files, Progress

# entry name -> its deployment fields
ENTRIES = {"gateway-cache": {"response_cache_mb": 64},
           "triton-cache": {"response_cache_mb": 64, "triton_response_cache": True},
           "uncached": {}}
MEASURED, BASELINE = "gateway-cache", "uncached"
REPEATED = [f"the package arrived on day {i} and it works" for i in range(8)]
PROCESSES = ("client", "gateway", "triton")  # whose CPU per request the rows show (the client is this process)
PLOT = "b9.png"
FILES = Files("bench-cache.json", "bench-cache.md", plots=(PLOT,))


def _texts(repeats: float, seed: int):
    """An endless supply of inputs: `repeats` of them from REPEATED, the others never seen before."""
    rng, n = random.Random(seed), 0
    while True:
        n += 1
        yield rng.choice(REPEATED) if rng.random() < repeats else f"review {seed}-{n}: {rng.random():.12f} stars"


def _hit_rates(gateway_metrics: str, triton_metrics: str) -> dict[str, float | None]:
    """Each cached entry's hit rate over the run, by the cache that answers it: the gateway's, Triton's."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {url: [s for family in text_string_to_metric_families(httpx.get(url, timeout=10).text)
                     for s in family.samples] for url in (gateway_metrics, triton_metrics)}

    def count(url: str, metric: str, **labels) -> float:
        return sum(s.value for s in samples[url] if s.name.removesuffix("_total") == metric.removesuffix("_total")
                   and labels.items() <= s.labels.items())

    def rate(hits: float, misses: float) -> float | None:
        return round(hits / (hits + misses), 4) if hits + misses else None

    lookups = metric_names.ANSWER_CACHE_LOOKUPS
    return {MEASURED: rate(count(gateway_metrics, lookups, model=MEASURED, outcome="hit"),
                           count(gateway_metrics, lookups, model=MEASURED, outcome="miss")),
            "triton-cache": rate(count(triton_metrics, "nv_cache_num_hits_per_model", model="triton-cache"),
                                 count(triton_metrics, "nv_cache_num_misses_per_model", model="triton-cache"))}


@contextlib.contextmanager
def _stack(work: Path, progress):
    """The entries in one tritonserver (with the cache the deployment sizes) behind the gateway (with the answer
    caches the deployment gives it): (gateway URL, Triton's metrics URL, each process's pid: this one, the client,
    too)."""
    from deploy.plan import plan
    from deploy.repository import assemble_repository, response_cache_args
    from deploy.services import Layout, gateway_settings
    from deploy.load import load_deployment
    from export.encoders.encoder import export_text_classification
    from fixture_models.text import write_text_classifier
    from export.triton.entry import EntryOptions
    from serve.stack import start_gateway, start_triton

    progress(f"writing and exporting the fixture classifier ({len(ENTRIES)} times)")
    checkpoint = write_text_classifier(work / "ckpt")
    for name in ENTRIES:
        export_text_classification(checkpoint, EntryOptions(name=name, instances=2), work / "exported")
    (work / "box.yaml").write_text(yaml.safe_dump({"name": "b9", "gpus": {"count": 0}, "models": [
        {"name": name, "kind": "encoder", "path": f"exported/{name}", **fields} for name, fields in ENTRIES.items()]}))
    d = load_deployment(work / "box.yaml")
    p = plan(d)
    triton, opts = start_triton(assemble_repository(d, p, work / "repository"), work / "logs",
                                extra_args=tuple(response_cache_args(d)))
    try:
        # Triton's cache measured alone: the gateway is told of no cache for that entry (a deployment gives it both)
        cached = {n: mb for n, mb in gateway_settings(d, Layout(), p)["response_cache_mb"].items() if n != "triton-cache"}
        gateway, url = start_gateway(f"127.0.0.1:{opts.grpc_port}", work / "logs",
                                     extra_env={"RTXSERVE_RESPONSE_CACHE_MB": json.dumps(cached)})
        try:
            yield url, f"http://127.0.0.1:{opts.metrics_port}/metrics", {
                "client": os.getpid(), "gateway": gateway.process.pid, "triton": triton.process.pid}
        finally:
            gateway.stop()
    finally:
        triton.stop()


async def _measure(url: str, pids: dict[str, int], *, rounds: int, duration_s: float, concurrency: int, repeats: float,
                   progress) -> dict:
    per_round: dict[str, list[dict]] = {name: [] for name in ENTRIES}

    def cpu() -> dict[str, float]:
        return {p: cpu_seconds(pid, children=p != "client") for p, pid in pids.items()}

    names = list(ENTRIES)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as client:
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:  # each entry first in turn
                texts = _texts(repeats, seed=i)

                async def request(name=name, texts=texts) -> bool:
                    body = {"model": name, "input": next(texts)}
                    return (await client.post(f"{url}/v1/classify", json=body)).status_code == 200

                before = cpu()
                latencies, errors, seconds = await closed_loop(request, concurrency, duration_s)
                summary = latency_summary(latencies, errors, seconds)
                for p, spent in cpu().items():  # where a request's CPU goes: the client, the gateway, Triton
                    summary[f"{p}_cpu_ms"] = round((spent - before[p]) * 1000 / max(1, len(latencies)), 3)
                per_round[name].append(summary)
                progress(f"round {i + 1}/{rounds}, {name}: {summary['qps']} QPS, P99 {summary['p99_ms']} ms")
    return {name: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for name, rs in per_round.items()} \
        | {"per_round": per_round}


def run(out: Path, *, rounds: int = 5, duration_s: float = 8.0, concurrency: int = 8, repeats: float = 0.5,
        progress=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rtxserve-b9-") as tmp, _stack(Path(tmp), progress) as (url, metrics, pids):
        measured = asyncio.run(_measure(url, pids, rounds=rounds, duration_s=duration_s, concurrency=concurrency,
                                        repeats=repeats, progress=progress))
        hit_rates = _hit_rates(f"{url}/metrics", metrics)
    result = {"bench": "B9", "target": 1.5, "cpu": machine(), "cores": os.cpu_count(), "rounds": rounds,
              "duration_s": duration_s,
              "concurrency": concurrency, "repeats": repeats, "hit_rates": hit_rates, **measured,
              "qps_ratio": round(measured[MEASURED]["qps"] / measured[BASELINE]["qps"], 3),
              "triton_qps_ratio": round(measured["triton-cache"]["qps"] / measured[BASELINE]["qps"], 3)}
    return FILES.save(out, result, markdown, plot)


def markdown(result: dict) -> str:
    def hits(name: str) -> str:
        rate = result["hit_rates"].get(name)
        return "–" if rate is None else f"{rate:.0%}"

    def cpu(name: str) -> str:  # rounds measured before the CPU was recorded have none
        return " / ".join(str(result[name].get(f"{p}_cpu_ms", "–")) for p in PROCESSES)

    rows = "\n".join(f"| {name} | {result[name]['qps']} | {result[name]['p50_ms']} | {result[name]['p99_ms']} | "
                     f"{result[name]['errors']} | {hits(name)} | {cpu(name)} |" for name in ENTRIES)
    return f"""# B9: answer caches ({result['repeats']:.0%} repeated inputs, classify through the gateway)

![QPS per entry, round by round]({PLOT})

Fixture classifier exported {len(ENTRIES)} times into one deployment: `gateway-cache` with `response_cache_mb` (the
gateway answers inputs it has seen; the others' rows are coalesced into Triton calls), `triton-cache` with
`triton_response_cache` (Triton's cache alone: the gateway, told of no cache for it, sends its requests one by one, as
that cache needs), and `uncached`; one tritonserver behind the gateway; {result['concurrency']} in flight, median of {result['rounds']}
rotating rounds x {result['duration_s']:g} s.
CPU: {result['cpu']}.

| entry | QPS | P50 ms | P99 ms | errors | hit rate | CPU-ms a request: {' / '.join(PROCESSES)} |
|---|---|---|---|---|---|---|
{rows}

QPS with the gateway's cache / without: **{result['qps_ratio']}** (target >= {result['target']}); with Triton's:
{result['triton_qps_ratio']}. Of the requests, {result['repeats']:.0%} repeat an earlier input.
{_bound(result)}"""


def _bound(result: dict) -> str:
    """The QPS the box's cores allow each entry: the cores' milliseconds over the CPU-ms one request costs the three
    processes together, beside the QPS measured (a box whose QPS is its CPU's is CPU-bound: a hit saves what it
    saves Triton and the gateway, never the client's share)."""
    if not result.get("cores") or any(f"{p}_cpu_ms" not in result[n] for n in ENTRIES for p in PROCESSES):
        return ""
    bounds = ", ".join(f"{n} {result['cores'] * 1000 / sum(result[n][f'{p}_cpu_ms'] for p in PROCESSES):.0f} "
                       f"({result[n]['qps']} measured)" for n in ENTRIES)
    return (f"\n{result['cores']} cores over the CPU-ms a request costs the three processes together: {bounds} "
            "requests/s. Where the two agree, the box is CPU-bound: a hit saves Triton's share and some of the gateway's, never "
            "the client's.\n")


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, (ax, spent) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, colour) in enumerate(zip(ENTRIES, ("tab:green", "tab:blue", "tab:gray"))):
        ax.bar(i, result[name]["qps"], color=colour, alpha=0.75)
        rounds = [r["qps"] for r in result["per_round"][name]]
        ax.scatter([i] * len(rounds), rounds, color="black", s=10, zorder=3)
        bottom = 0.0
        for process, shade in zip(PROCESSES, ("tab:purple", "tab:orange", "tab:cyan")):
            ms = result[name].get(f"{process}_cpu_ms")
            if ms is not None:
                spent.bar(i, ms, bottom=bottom, color=shade, label=process if i == 0 else None)
                bottom += ms
    for a in (ax, spent):
        a.set_xticks(range(len(ENTRIES)), list(ENTRIES))
    ax.set_ylabel("classify QPS through the gateway")
    ax.set_xlabel("bars: the median of the rounds; dots: each round", fontsize=8)  # a legend hid a round's dot
    spent.set_ylabel("CPU-ms a request (median of the rounds)")
    if spent.has_data():
        spent.legend(fontsize=8)
    return save(fig, path, f"B9: answer caches, {result['repeats']:.0%} repeated inputs: gateway's "
                           f"{result['qps_ratio']}x QPS (target {result['target']}x)")


# --- `rtxserve bench cache` -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
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
    name="cache", id="B9", title="answer caches",
    help="B9: classify QPS with the gateway's answer cache (and Triton's) / without, at repeated inputs",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

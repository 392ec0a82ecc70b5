"""`rtxserve bench swap` (B12): more fine-tunes than the box holds at once, under Zipf traffic, through `serve up`.

A CPU box (the deployment file this benchmark writes, started by `rtxserve serve up` as a user's would be): six
classifier fine-tunes (the fixture classifier exported under six names) and two LLM variants (the fixture tiny
Llama under two names, each its own vLLM engine), all `resident: on-demand`, sharing a swap room that holds two
classifiers and one engine. A real locust mix sends classify requests over the six and chat requests over the two,
as Poisson arrivals (open loop), each set with Zipf popularity (the k-th model of a set is asked for in proportion to 1/k). The gateway loads what
is asked for (Triton's repository API; an engine is started by its engine_control) and unloads the least recently
used idle model to make room.

Measured: P50 / P99 per model (the client's, every request), the share of requests that waited for a load, and
the load and unload seconds the gateway counted (a Triton entry's load; a CPU engine's start and stop). The plot
is the load test's latency over time with each load and unload marked.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from core import metric_names

from .record import Benchmark, Files, Progress

log = logging.getLogger("rtxserve.bench")
CLASSIFIERS = tuple(f"reviews-{i}" for i in range(1, 7))
VARIANTS = ("chat-a", "chat-b")
PLOT = "swap.png"
FILES = Files("swap.json", "swap.md", plots=(PLOT,))


def _zipf(models: tuple[str, ...], api: str, share: float) -> list[str]:
    """`api:model:weight` entries: the k-th model 1/k of the first's weight, the set's weights summing to `share`."""
    weights = [1 / k for k in range(1, len(models) + 1)]
    return [f"{api}:{m}:{share * w / sum(weights):.4f}" for m, w in zip(models, weights)]


def write_box(work: Path, progress: Progress) -> Path:
    """The fixtures, exported, and the deployment file naming them (the swap room: two classifiers and one engine)."""
    from deploy.plan import plan
    from deploy.load import load_deployment
    from export.encoders.encoder import export_text_classification
    from export.triton.entry import EntryOptions
    from fixture_models.llm import write_llm
    from fixture_models.text import write_text_classifier

    progress("training the fixture classifier and exporting it under six names")
    checkpoint = write_text_classifier(work / "ckpt")
    for name in CLASSIFIERS:
        export_text_classification(checkpoint, EntryOptions(name=name), work / "model_repository")
    progress("writing the fixture Llama")
    write_llm(work / "llm")
    models = [{"name": n, "kind": "encoder", "path": f"model_repository/{n}", "resident": "on-demand"}
              for n in CLASSIFIERS]
    models += [{"name": n, "kind": "llm", "path": "llm", "max_model_len": 512, "kv_cache_gib": 1,
                "resident": "on-demand", "vllm_args": ["--enforce-eager"]} for n in VARIANTS]
    spec = {"name": "bench-swap", "gpus": {"count": 0}, "models": models,
            "gateway": {"settings": {"load_wait_s": 300, "max_tokens": 64}}}
    path = work / "box.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    p = plan(load_deployment(path))
    spec["swap_room_gib"] = round(2 * p.on_demand[CLASSIFIERS[0]] + p.on_demand[VARIANTS[0]] + 0.01, 3)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _gateway_figures(url: str) -> dict:
    """Per model: the requests that waited for a load, loads, unloads, and mean load and unload seconds."""
    wanted = {metric_names.LOAD_WAITS: "waited", metric_names.MODEL_LOADS: "loads",
              metric_names.MODEL_UNLOADS: "unloads"}
    sums = {f"{metric_names.MODEL_LOAD_SECONDS}_sum": "load_s", f"{metric_names.MODEL_LOAD_SECONDS}_count": "load_n",
            f"{metric_names.MODEL_UNLOAD_SECONDS}_sum": "unload_s",
            f"{metric_names.MODEL_UNLOAD_SECONDS}_count": "unload_n"}
    out: dict[str, dict] = {}
    requests = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            model = s.labels.get("model", "")
            if s.name == metric_names.REQUESTS and s.labels.get("route", "").startswith("/v1/"):
                requests += s.value
            key = wanted.get(s.name) or sums.get(s.name)
            if key and model:
                row = out.setdefault(model, {})
                row[key] = row.get(key, 0.0) + s.value
    for row in out.values():
        row["load_mean_s"] = row.pop("load_s", 0.0) / row.pop("load_n", 0.0) if row.get("load_n") else None
        row["unload_mean_s"] = row.pop("unload_s", 0.0) / row.pop("unload_n", 0.0) if row.get("unload_n") else None
    return {"models": out, "requests": requests}


def run(out: Path, *, duration_s: float = 120.0, rate: float = 1.0, progress=log.info) -> dict:
    from core.machine import machine
    from deploy.box import down, up
    from deploy.load import load_deployment
    from loadtest.runner import LoadSpec, run as load_run, scenario_options

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rtxserve-bench-swap-") as tmp:
        work = Path(tmp)
        d = load_deployment(write_box(work, progress))
        progress("rtxserve serve up: Triton in explicit model control, two engine controls, the gateway")
        run_folder = up(d, root=work / "state", log=progress)
        try:
            url = f"http://127.0.0.1:{d.ports.gateway}"
            mix = ",".join(_zipf(CLASSIFIERS, "classify", 0.75) + _zipf(VARIANTS, "chat", 0.25))
            progress(f"Poisson arrivals at {rate:g} requests/s for {duration_s:g} s: {mix}")
            options = scenario_options(scenario="mix", mix=mix, output_len=16, request_timeout=600.0, arrival="poisson",
                                       rate=rate)
            spec = LoadSpec(url, options, duration_s=duration_s, warmup_s=0.0, scrape=[f"{url}/metrics"])
            report = load_run(spec, out / "report", log=progress)
            gateway = _gateway_figures(url)
            shutil.copy(out / "report" / "latency.png", out / PLOT)
        finally:
            down(run_folder, log=progress)
    s = report.summary
    waited = sum(m.get("waited", 0.0) for m in gateway["models"].values())
    result = {"bench": "B12", "machine": machine(), "duration_s": duration_s, "rate": rate,
              "swap_room_gib": d.swap_room_gib, "requests": s.requests, "errors": s.errors,
              "error_kinds": s.error_kinds, "waited_share": waited / gateway["requests"] if gateway["requests"] else None,
              "by_model": {m: {"p50_ms": f["latency_ms"]["p50"], "p99_ms": f["latency_ms"]["p99"],
                               "requests": f["requests"]} for m, f in s.by_model.items()},
              "gateway": gateway["models"]}
    (out / FILES.json).write_text(json.dumps(result, indent=2))
    (out / FILES.page).write_text(markdown(result))
    return result


def markdown(r: dict) -> str:
    rows = []
    for model in (*CLASSIFIERS, *VARIANTS):
        f, g = r["by_model"].get(model, {}), r["gateway"].get(model, {})
        seconds = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        rows.append(f"| {model} | {f.get('requests', 0)} | {f.get('p50_ms', float('nan')):.0f} | "
                    f"{f.get('p99_ms', float('nan')):.0f} | {g.get('waited', 0):.0f} | {g.get('loads', 0):.0f} | "
                    f"{g.get('unloads', 0):.0f} | {seconds(g.get('load_mean_s'))} | {seconds(g.get('unload_mean_s'))} |")
    share = r["waited_share"]
    kinds = f" ({', '.join(f'{k}: {v}' for k, v in r['error_kinds'].items())})" if r["errors"] else ""
    return f"""### B12: more fine-tunes than the box holds (CPU box, `serve up`; {r['machine']})

Six classifier fine-tunes and two LLM variants, all on demand, in a swap room of {r['swap_room_gib']:g} GiB (two
classifiers and one engine); Poisson arrivals at {r['rate']:g} requests/s for {r['duration_s']:g} s (open loop: a request
arrives whether or not the last was answered), 3/4 classify and 1/4 chat, each set with Zipf popularity.
{r['requests']} requests, {r['errors']} errors{kinds};
**{share:.1%} of them waited for a load**. Loads and unloads are the gateway's counts; their seconds its histograms'
means (a classifier: Triton's load of the entry and its first answer; an LLM variant: its vLLM engine started,
or stopped).

![latency over time, each load and unload marked]({PLOT})

| model | requests | P50 ms | P99 ms | waited for a load | loads | unloads | load s (mean) | unload s (mean) |
|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-swap-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.duration < 10 or args.rate <= 0:
        return "need --duration >= 10 and --rate > 0"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, duration_s=args.duration, rate=args.rate, progress=progress)


BENCHMARK = Benchmark(
    name="swap", id="B12", title="many fine-tunes on one box",
    help="six classifier fine-tunes and two LLM variants on demand in a room for two and one, under Zipf traffic "
         "through serve up: P50 / P99 per model, the share that waited for a load, load and unload seconds",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

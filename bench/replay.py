"""`rtxserve bench replay`: benchmark B13 (issue 43), real traffic replayed and the capacity it answers.

One vLLM CPU engine serves the fixture Llama (prefix caching on, vLLM's default) behind a gateway that records its
trace. A locust run sends streamed chat requests open loop (Poisson), each opening with a system prompt every
request shares (what vLLM's prefix cache holds for all), and the gateway records it. Then:

- **fidelity**: the recording is replayed against the same box (`rtxserve loadtest replay`); recorded and replayed
  are compared: arrivals per time bin (their correlation), prompt and output lengths, and vLLM's prefix-cache hit
  rate during each (its counters read before and after). Targets: correlation >= 0.9; mean prompt length, output
  tokens and hit rate within 10 % of the recording.
- **capacity**: `rtxserve capacity` with the recording as its load (each step the trace at the speed that makes its
  mean rate the step's, pass after pass for 15 s) under an SLO; its confirm runs at 0.9x and 1.1x the answer should hold and miss.

vLLM runs the model in its engine core (serve.vllm_server.TWO_PROCESSES), as B14 does.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
from pathlib import Path

from .record import Benchmark, Files, Progress

SERVED = "bench-llm"
PLOT = "b13.png"
FILES = Files("bench-replay.json", "bench-replay.md", plots=(PLOT,))
TARGETS = {"arrivals_correlation": (">=", 0.9), "prompt_tokens_ratio": ("within", 0.1),
           "output_tokens_ratio": ("within", 0.1), "prefix_hit_rate_ratio": ("within", 0.1)}


def _prefix_hit_rate(vllm_url: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) of vLLM's prefix cache so far."""
    import httpx

    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    found = dict.fromkeys(("hits", "queries"), 0.0)
    for name, value in re.findall(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} ([0-9.e+]+)$", text, re.M):
        found[name] += float(value)
    return found["hits"], found["queries"]


def _during(vllm_url: str, work):
    """`work()`'s result and vLLM's prefix-cache hit rate over it."""
    hits, queries = _prefix_hit_rate(vllm_url)
    result = work()
    hits2, queries2 = _prefix_hit_rate(vllm_url)
    return result, (hits2 - hits) / (queries2 - queries) if queries2 > queries else None


def _met(value, op: str, target: float) -> bool:
    if value is None:
        return False
    return value >= target if op == ">=" else abs(value - 1) <= target


def run(out: Path, *, rate: float = 2.0, duration_s: float = 60.0, system_words: int = 96, output_len: int = 16,
        slo: str = "e2el:2000", progress=print) -> dict:
    from core.machine import machine
    from fixture_models.llm import write_llm
    from loadtest.capacity import search
    from loadtest.report.report import load_samples
    from loadtest.runner import LoadSpec, run as load
    from loadtest.runner import scenario_options
    from loadtest.scenarios.replayer import await_trace
    from serve.stack import start_gateway, start_vllm
    from serve.vllm_server import TWO_PROCESSES, VLLMOptions

    out.mkdir(parents=True, exist_ok=True)
    for old in ("trace", "recording", "recorded", "replayed", "capacity"):  # a run before this one's
        shutil.rmtree(out / old, ignore_errors=True)
    model = write_llm(out / "tiny-llama", max_length=2048)
    quiet = lambda m: progress(f"  {m}")  # noqa: E731
    with contextlib.ExitStack() as stack:
        engine, vllm_url = start_vllm(VLLMOptions(model=model, served_name=SERVED, max_model_len=2048), out / "vllm",
                                      timeout_s=900, env=TWO_PROCESSES)
        stack.callback(engine.stop)
        gateway, url = start_gateway("", out / "gateway", vllm_url=vllm_url,
                                     extra_env={"RTXSERVE_TRACE_DIR": str(out / "trace")})
        stack.callback(gateway.stop)
        scrape = [f"{vllm_url}/metrics"]
        progress(f"B13: recording {duration_s:g} s of chat at {rate:g} requests/s")
        options = scenario_options(scenario="chat", model=SERVED, arrival="poisson", rate=rate, output_len=output_len,
                                   system_prompt_words=system_words)
        recorded, recorded_hits = _during(vllm_url, lambda: load(
            LoadSpec(url, options, duration_s=duration_s, warmup_s=0, scrape=scrape), out / "recorded", log=quiet))
        await_trace(out / "trace", len(load_samples(out / "recorded" / "samples.csv").end))  # every request recorded
        shutil.copytree(out / "trace", out / "recording")
        progress("B13: replaying the recording")
        replay = scenario_options(scenario="replay", arrival="trace", trace=str(out / "recording"))
        replayed, replayed_hits = _during(vllm_url, lambda: load(
            LoadSpec(url, replay, warmup_s=0, scrape=scrape), out / "replayed", log=quiet))
        progress(f"B13: capacity of this traffic at {slo}")
        found = search(LoadSpec(url, replay, duration_s=15, warmup_s=2, slo=slo, scrape=scrape), out / "capacity",
                       start=rate, precision=0.1, log=quiet)
    figures = replayed.summary.replay
    rec, rep = figures["recorded"], figures["replayed"]
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    fidelity = {
        "requests": (rec["requests"], rep["requests"]), "errors": (recorded.summary.errors, replayed.summary.errors),
        "arrivals_correlation": figures["arrivals"]["correlation"],
        "prompt_tokens_mean": (rec["input_tokens"].get("mean"), rep["input_tokens"].get("mean")),
        "output_tokens_mean": (rec["output_tokens"].get("mean"), rep["output_tokens"].get("mean")),
        "prefix_hit_rate": (recorded_hits, replayed_hits),
        "latency_p99_ms": (rec["latency_ms"].get("p99"), rep["latency_ms"].get("p99")),
        "ttft_p99_ms": (rec["ttft_ms"].get("p99"), rep["ttft_ms"].get("p99")),
    }
    fidelity |= {"prompt_tokens_ratio": ratio(*fidelity["prompt_tokens_mean"][::-1]),
                 "output_tokens_ratio": ratio(*fidelity["output_tokens_mean"][::-1]),
                 "prefix_hit_rate_ratio": ratio(*fidelity["prefix_hit_rate"][::-1])}
    confirms = {s["phase"]: s["holds"] for s in found.steps if s["phase"].startswith("confirm")}
    capacity = {"answer_rps": found.answer, "headline": found.headline, "steps": len(found.steps),
                "confirm_0.9x_holds": confirms.get("confirm-0.9x"), "confirm_1.1x_holds": confirms.get("confirm-1.1x"),
                "report": "capacity/capacity.md"}
    result = {"bench": "B13", "model": "fixture Llama (tiny), one vLLM CPU engine", "machine": machine(), "rate": rate,
              "duration_s": duration_s, "system_words": system_words, "output_len": output_len, "slo": slo,
              "fidelity": fidelity, "capacity": capacity,
              "verdict": {k: _met(fidelity[k], op, v) for k, (op, v) in TARGETS.items()}
              | {"confirmed": confirms.get("confirm-0.9x") is True and confirms.get("confirm-1.1x") is False}}
    return FILES.save(out, result, markdown, lambda _, path: shutil.copy(out / "replayed" / "replay.png", path))


def markdown(result: dict) -> str:
    f, c, v = result["fidelity"], result["capacity"], result["verdict"]
    fmt = lambda x: "–" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)  # noqa: E731
    rows = "\n".join(f"| {label} | {fmt(f[key][0])} | {fmt(f[key][1])} |" for key, label in (
        ("requests", "requests"), ("errors", "failed"), ("prompt_tokens_mean", "prompt tokens, mean"),
        ("output_tokens_mean", "output tokens, mean"), ("prefix_hit_rate", "vLLM prefix-cache hit rate"),
        ("latency_p99_ms", "latency P99 ms"), ("ttft_p99_ms", "TTFT P99 ms")))
    mark = lambda key: "met" if v[key] else "**missed**"  # noqa: E731
    return f"""## B13: real traffic replayed, capacity answered ({result['model']}; streamed chat, Poisson {result['rate']:g} requests/s for {result['duration_s']:g} s, a {result['system_words']}-word system prompt shared, {result['output_len']} tokens out)

![arrivals and sizes, recorded vs replayed]({PLOT})

CPU: {result['machine']}.

| figure | recorded | replayed |
|---|---|---|
{rows}

- Arrivals per time bin correlated **{fmt(f['arrivals_correlation'])}** (target >= 0.9: {mark('arrivals_correlation')}).
- Replayed / recorded: prompt tokens **{fmt(f['prompt_tokens_ratio'])}** ({mark('prompt_tokens_ratio')}), output tokens
  **{fmt(f['output_tokens_ratio'])}** ({mark('output_tokens_ratio')}), prefix-cache hit rate
  **{fmt(f['prefix_hit_rate_ratio'])}** ({mark('prefix_hit_rate_ratio')}); targets within 10 %.
- Capacity of this traffic ({result['slo']}): **{c['headline']}** ({c['steps']} steps, each its own report; the
  confirm runs {'uphold the answer' if v['confirmed'] else '**do not uphold the answer**'}).
"""


# --- `rtxserve bench replay` -------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=2.0, help="the recorded run's requests/s (Poisson)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds recorded")
    parser.add_argument("--system-words", type=int, default=96, help="the shared system prompt's words")
    parser.add_argument("--output-len", type=int, default=16, help="tokens each answer asks for at most")
    parser.add_argument("--slo", default="e2el:2000", help="the capacity search's SLO")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-replay-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rate <= 0 or args.duration <= 0 or args.system_words < 0 or args.output_len < 1:
        return "need --rate > 0, --duration > 0, --system-words >= 0 and --output-len >= 1"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rate=args.rate, duration_s=args.duration, system_words=args.system_words,
               output_len=args.output_len, slo=args.slo, progress=progress)


BENCHMARK = Benchmark(
    name="replay", id="B13", title="real traffic replayed, capacity answered",
    help="B13: a recorded chat run replayed (arrivals, sizes, prefix-cache hits) and its capacity with confirm runs",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

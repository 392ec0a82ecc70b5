"""`rtxserve bench llm`: vLLM benchmarks B4 (CPU and GPU) and, on a GPU, G2 and G3 (see shared BENCH.md).

B4  output tokens/s with 16 concurrent streams / with 1. Concurrency levels run interleaved, in a
    different order each round, several rounds; figures are medians, so a noisy neighbour hits all
    levels alike. Requests use `ignore_eos` so that every one generates exactly `max_tokens`, and are
    not streamed, so per-token event handling does not cap the figure. The default model is the
    "small" Llama fixture (58M parameters): on the 2-layer test model, serving overhead, not the
    model, bounds decoding, which no real LLM shows.
G2  decode at batch 1 on an 8B-shaped FP16 model with random weights (vLLM `--load-format dummy`):
    tokens/s ÷ (memory bandwidth ÷ weight bytes), the fraction of the memory roofline reached.
G3  the same model under Poisson arrivals: the highest rate whose P99 time to first token ≤ 500 ms.

The benchmark talks to vLLM directly (the gateway's own overhead is B1's business).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from httpx_sse import EventSource

from .record import Benchmark, Files, Progress

log = logging.getLogger("rtxserve.bench")
PLOT = "b4.png"  # B4's; the GPU benchmarks have tables only
FILES = Files("bench-llm.json", "bench-llm.md", plots=(PLOT,))

# Peak memory bandwidth (GB/s) by GPU name, from the vendors' data sheets; --bandwidth-gbs overrides.
GPU_BANDWIDTH_GBS = {
    "H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
    "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300,
    "RTX 4090": 1008, "RTX 3090": 936, "RTX 6000 Ada": 960,
}
# Llama-3-8B's shape.
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
            "rope_theta": 500000.0, "tie_word_embeddings": False}


# --- measuring --------------------------------------------------------------------------------

@dataclass
class Completion:
    ok: bool
    tokens: int = 0
    ttft_s: float = math.nan
    latency_s: float = math.nan
    error: str = ""


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                   stream: bool = True) -> Completion:
    """One completion of exactly `max_tokens` tokens; streamed: times to first token and to the end.
    Not streamed (for throughput): no TTFT, and no per-token events for the server and client to handle."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    started = time.perf_counter()
    first, tokens = math.nan, 0
    if not stream:
        try:
            response = await client.post(f"{url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return Completion(False, error=f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            return Completion(False, error=f"HTTP {response.status_code}: {response.text[:200]}")
        tokens = response.json()["usage"]["completion_tokens"]
        return Completion(tokens > 0, tokens, first, time.perf_counter() - started, "" if tokens else "no tokens")
    body["stream_options"] = {"include_usage": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Completion(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for event in EventSource(response).aiter_sse():  # SSE's own line ends (see serve/gateway/backends/vllm.py)
                if not event.data or event.data == "[DONE]":
                    continue
                chunk = json.loads(event.data)
                if chunk.get("choices") and math.isnan(first):
                    first = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Completion(False, error=f"{type(exc).__name__}: {exc}")
    return Completion(tokens > 0, tokens, first, time.perf_counter() - started, "" if tokens else "no tokens")


async def closed_loop(url: str, model: str, streams: int, duration_s: float, max_tokens: int, prompts: list[str]) -> dict:
    """`streams` clients, each sending its next request as soon as the last ended, for `duration_s`.

    Output tokens/s counts the tokens of requests that ended, over the time from the start to the
    last end (a request still running at the deadline is awaited and counted)."""
    deadline = time.perf_counter() + duration_s
    results: list[Completion] = []

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.perf_counter() < deadline:
            results.append(await complete(client, url, model, prompts[(i + n) % len(prompts)], max_tokens, stream=False))
            n += 1

    limits = httpx.Limits(max_connections=streams + 4)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(streams)))
    wall = time.perf_counter() - started
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(results)} requests failed at {streams} stream(s), e.g. {errors[0]}")
    return {"streams": streams, "requests": len(ok), "tokens": sum(r.tokens for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r.tokens for r in ok) / wall}


def prompts_for(seed: int = 0, count: int = 32, words: tuple[int, int] = (8, 40)) -> list[str]:
    rng = random.Random(seed)
    vocab = "the model answers questions about orders shipping and refunds hello how can i help you today".split()
    return [" ".join(rng.choices(vocab, k=rng.randint(*words))) for _ in range(count)]


def b4(url: str, model: str, *, levels=(1, 2, 4, 8, 16), rounds: int = 3, duration_s: float = 6.0,
       max_tokens: int = 64, progress=log.info) -> dict:
    """Output tokens/s per concurrency level, interleaved over rounds; B4 = median(16) / median(1)."""
    if 1 not in levels or 16 not in levels:
        raise ValueError("B4 needs the levels 1 and 16")
    prompts = prompts_for()
    asyncio.run(closed_loop(url, model, max(levels), min(duration_s, 3.0), max_tokens, prompts))  # warm-up
    runs: dict[int, list[float]] = {c: [] for c in levels}
    for r in range(rounds):
        order = list(levels) if r % 2 == 0 else list(reversed(levels))
        for c in order:
            figures = asyncio.run(closed_loop(url, model, c, duration_s, max_tokens, prompts))
            runs[c].append(figures["tokens_per_s"])
            progress(f"  round {r + 1}/{rounds}: {c:>2} stream(s) {figures['tokens_per_s']:8.1f} output tokens/s "
                     f"({figures['requests']} requests)")
    medians = {c: statistics.median(v) for c, v in runs.items()}
    return {
        "id": "B4", "what": "vLLM output tokens/s at 16 concurrent streams / at 1 stream", "target": 5.0,
        "ratio": medians[16] / medians[1], "median_tokens_per_s": medians, "rounds": runs,
        "settings": {"rounds": rounds, "duration_s": duration_s, "max_tokens": max_tokens, "ignore_eos": True},
    }


# --- the GPU benchmarks -----------------------------------------------------------------------

def llama_params(config: dict) -> int:
    """Parameter count of a Llama-architecture config (embeddings, attention, MLP, norms, head)."""
    h, i, n, v = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    head = 0 if config.get("tie_word_embeddings") else v * h
    return v * h + n * per_layer + h + head


def gpu_bandwidth_gbs(name: str) -> float | None:
    """Peak bandwidth of the GPU called `name` (nvidia-smi's name), longest matching key first."""
    for key in sorted(GPU_BANDWIDTH_GBS, key=len, reverse=True):
        if key.lower() in name.lower():
            return float(GPU_BANDWIDTH_GBS[key])
    return None


def roofline(tokens_per_s: float, bandwidth_gbs: float, weight_bytes: int) -> dict:
    """At batch 1 every decoded token reads every weight once: the ceiling is bandwidth / weight bytes."""
    ceiling = bandwidth_gbs * 1e9 / weight_bytes
    return {"tokens_per_s": tokens_per_s, "roofline_tokens_per_s": ceiling, "fraction": tokens_per_s / ceiling}


def write_8b_model(out: Path) -> Path:
    """An 8B-shaped Llama folder without weights (vLLM fills them with `--load-format dummy`), with a
    byte-level tokenizer padded to the 128,256-token vocabulary so that every sampled id decodes."""
    from fixture_models.llm import train_chat_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_chat_tokenizer(LLAMA_8B["max_position_embeddings"])
    tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(LLAMA_8B["vocab_size"] - len(tokenizer))])
    tokenizer.save_pretrained(out)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float16", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
              **LLAMA_8B}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def g2(url: str, model: str, config: dict, bandwidth_gbs: float, *, max_tokens: int = 256, rounds: int = 5) -> dict:
    """Batch-1 decode speed, from the time between the first and the last token (prefill excluded)."""
    speeds = []
    for _ in range(rounds):
        async def one():
            async with httpx.AsyncClient(timeout=600) as client:
                return await complete(client, url, model, "hello", max_tokens)
        result = asyncio.run(one())
        if not result.ok:
            raise RuntimeError(f"G2 request failed: {result.error}")
        speeds.append((result.tokens - 1) / (result.latency_s - result.ttft_s))
    weight_bytes = llama_params(config) * 2
    return {"id": "G2", "target": 0.8, "weight_bytes": weight_bytes, "bandwidth_gbs": bandwidth_gbs,
            "rounds": speeds, **roofline(statistics.median(speeds), bandwidth_gbs, weight_bytes)}


def g3(url: str, model: str, out: Path, *, slo_ttft_ms: float = 500.0, start_rate: float = 2.0,
       duration_s: float = 30.0, max_tokens: int = 128, progress=log.info) -> dict:
    """The highest Poisson arrival rate whose P99 TTFT meets the SLO: `rtxserve loadtest sweep` (the one load
    generator), doubling the rate from `start_rate` until the server is over-saturated."""
    from loadtest.runner import LoadSpec, scenario_options
    from loadtest.sweep import sweep

    options = scenario_options(scenario="completions", model=model, arrival="poisson", prompt_words="64,256",
                               output_len=max_tokens, ignore_eos="on", temperature=0.0)
    spec = LoadSpec(url, options, duration_s=duration_s, warmup_s=min(5.0, duration_s / 4), slo=f"ttft:{slo_ttft_ms:g}")
    result = sweep(spec, out / "g3-sweep", start=start_rate, max_steps=8, log=progress)
    return {"id": "G3", "slo_p99_ttft_ms": slo_ttft_ms, "max_rate": result.verdict["max_load_within_slo"] or 0.0,
            "max_qps": result.verdict["max_qps_within_slo"] or 0.0, "steps": result.steps, "report": str(result.report),
            "settings": {"duration_s": duration_s, "max_tokens": max_tokens, "prompt_words": [64, 256]}}


# --- report -----------------------------------------------------------------------------------

def plot_b4(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    levels = sorted(result["rounds"], key=int)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in levels:
        ax.scatter([int(c)] * len(result["rounds"][c]), result["rounds"][c], color="tab:blue", alpha=0.4, s=14)
    ax.plot([int(c) for c in levels], [result["median_tokens_per_s"][c] for c in levels], marker="o", color="tab:blue",
            label="median over rounds")
    one = result["median_tokens_per_s"][levels[0]]
    ax.plot([int(c) for c in levels], [one * int(c) for c in levels], linestyle=":", color="gray", label="linear scaling")
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(c) for c in levels], [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens / s")
    ax.legend()
    return save(fig, path, f"vLLM continuous batching: 16 streams / 1 = {result['ratio']:.1f}x (target ≥ 5x)")


def markdown(results: dict) -> str:
    lines = ["# rtxserve bench llm", "", f"vLLM {results['versions'].get('vllm', '?')} on {results['device']}; "
             f"model {results['model']}.", ""]
    if "B4" in results:
        b4r = results["B4"]
        lines += ["## B4: continuous batching", "", f"![tokens/s vs streams]({PLOT})", "",
                  "| streams | output tokens/s (median) | rounds |", "|---|---|---|"]
        lines += [f"| {c} | {v:.1f} | {', '.join(f'{x:.1f}' for x in b4r['rounds'][c])} |"
                  for c, v in b4r["median_tokens_per_s"].items()]
        lines += ["", f"**B4 = {b4r['ratio']:.2f}x** (target ≥ {b4r['target']:g}x)", ""]
    if "G2" in results:
        g = results["G2"]
        lines += ["## G2: batch-1 decode vs the memory roofline", "",
                  f"{g['tokens_per_s']:.1f} tokens/s; roofline {g['roofline_tokens_per_s']:.1f} tokens/s "
                  f"({g['bandwidth_gbs']:g} GB/s ÷ {g['weight_bytes'] / 1e9:.2f} GB) → **{g['fraction']:.2f}** (target ≥ 0.8)", ""]
    if "G3" in results:
        g = results["G3"]
        lines += ["## G3: Poisson arrivals, P99 TTFT ≤ 500 ms", "", f"(`rtxserve loadtest sweep`; report: {g['report']})", "",
                   "| req/s | QPS | P99 TTFT ms | errors |", "|---|---|---|---|"]
        lines += [f"| {s['load']:g} | {s['qps']:.1f} | {s['ttft_p99_ms'] or float('nan'):.1f} | {s['errors']} |"
                  for s in g["steps"]]
        lines += ["", f"**max QPS within the SLO: {g['max_qps']:.1f}**", ""]
    return "\n".join(lines) + "\n"


@dataclass
class BenchOptions:
    out: Path
    model: Path | None = None
    url: str = ""
    served_name: str = "bench-llm"
    rounds: int = 3
    duration_s: float = 6.0
    max_tokens: int = 64
    gpu: bool = False
    bandwidth_gbs: float | None = None
    g3_duration_s: float = 30.0
    skip: set = field(default_factory=set)


def _vllm_version(url: str) -> str:
    try:
        return httpx.get(f"{url}/version", timeout=5).json().get("version", "?")
    except (httpx.HTTPError, ValueError):
        return "?"


def _gpu_name() -> str | None:
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def run(opts: BenchOptions, progress=log.info) -> dict:
    """Start vLLM (unless `opts.url` names a running one), run the benchmarks, write JSON + Markdown + plot."""
    import platform
    from contextlib import ExitStack

    from serve.stack import start_vllm
    from serve.vllm_server import VLLMOptions

    opts.out.mkdir(parents=True, exist_ok=True)
    gpu = _gpu_name()
    if opts.gpu and gpu is None:
        raise RuntimeError("--gpu needs an NVIDIA GPU (nvidia-smi found none); B4 runs without --gpu")
    results: dict = {"device": gpu or f"CPU ({platform.processor() or platform.machine()})", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with ExitStack() as stack:
        url, name = opts.url, opts.served_name
        if opts.gpu:
            model = write_8b_model(opts.out / "llama-8b-shape")
            extra = ["--load-format", "dummy", "--gpu-memory-utilization", "0.85"]
            vopts = VLLMOptions(model=model, served_name=name, dtype="float16", max_model_len=4096, extra_args=extra)
        else:
            model = opts.model
            if model is None:
                from fixture_models.llm import write_llm

                model = write_llm(opts.out / "small-llama", shape="small")
            vopts = VLLMOptions(model=model, served_name=name, max_model_len=512, kv_cache_gib=2)
        results["model"] = str(model) if not url else f"{name} at {url}"
        if not url:
            progress(f"starting vLLM for {model} (log: {opts.out / 'vllm.log'})")
            server, url = start_vllm(vopts, opts.out, timeout_s=900)
            stack.callback(server.stop)
        results["versions"] = {"vllm": _vllm_version(url)}
        if "B4" not in opts.skip:
            progress(f"B4: output tokens/s at 1..16 streams, {opts.rounds} interleaved rounds of {opts.duration_s:g}s each")
            results["B4"] = b4(url, name, rounds=opts.rounds, duration_s=opts.duration_s, max_tokens=opts.max_tokens,
                               progress=progress)
            plot_b4(results["B4"], opts.out / PLOT)
        if opts.gpu:
            config = json.loads((Path(model) / "config.json").read_text())
            bandwidth = opts.bandwidth_gbs or gpu_bandwidth_gbs(gpu)
            if bandwidth is None:
                raise RuntimeError(f"no bandwidth on record for {gpu}; pass --bandwidth-gbs")
            progress(f"G2: batch-1 decode on {gpu} ({bandwidth:g} GB/s)")
            results["G2"] = g2(url, name, config, bandwidth)
            progress("G3: Poisson arrivals, doubling the rate until P99 TTFT > 500 ms")
            results["G3"] = g3(url, name, opts.out, duration_s=opts.g3_duration_s, progress=progress)
    (opts.out / FILES.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    (opts.out / FILES.page).write_text(markdown(results))
    return results


# --- `rtxserve bench llm` -------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="model folder (default: the tiny Llama fixture, written fresh)")
    parser.add_argument("--url", default="",
                        help="benchmark a vLLM server already running here instead of starting one")
    parser.add_argument("--served-name", default="bench-llm", help="model name at --url")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per concurrency level and round")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--gpu", action="store_true", help="8B-shaped FP16 model with random weights; adds G2 and G3")
    parser.add_argument("--bandwidth-gbs", type=float,
                        help="GPU memory bandwidth for G2 (default: from the GPU's name)")
    parser.add_argument("--g3-duration", type=float, default=30.0, help="seconds of Poisson arrivals per G3 rate")
    parser.add_argument("--skip-b4", action="store_true", help="with --gpu: only G2 and G3")
    parser.add_argument("--out", type=Path,
                        help="folder for bench-llm.json/.md and b4.png (default reports/bench-llm-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.duration <= 0 or args.max_tokens < 2:
        return "need --rounds >= 1, --duration > 0 and --max-tokens >= 2"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(BenchOptions(out=out, model=args.model, url=args.url.rstrip("/"), served_name=args.served_name,
                            rounds=args.rounds, duration_s=args.duration, max_tokens=args.max_tokens, gpu=args.gpu,
                            bandwidth_gbs=args.bandwidth_gbs, g3_duration_s=args.g3_duration,
                            skip={"B4"} if args.skip_b4 else set()),
               progress=progress)


BENCHMARK = Benchmark(
    name="llm", id="B4", title="vLLM continuous batching",
    help="B4 (vLLM tokens/s at 16 streams vs 1); with --gpu also G2 and G3",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

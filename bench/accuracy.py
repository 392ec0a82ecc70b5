"""`rtxserve bench accuracy`: benchmark B6 of the shared BENCH.md, whether `rtxserve loadtest` measures what
`vllm bench serve` (the reference users trust) measures.

Both send the same workload to the same vLLM server: random-token prompts of the model's tokenizer
(`--dataset-name random` / `--workload random`, the same input and output lengths, `ignore_eos`), streamed
completions, the same number of requests in flight (`--max-concurrency` / closed-loop users). They run
interleaved, in alternating order, over several rounds; each tool's figure is its median over rounds, and
B6 is the ratio of ours to vLLM's for TTFT P50 / P99 and end-to-end latency P50 / P99 (target 0.9-1.1 each).
Two conventions differ and are kept: our percentiles are nearest-rank (a latency that was observed, as HDR
histograms report), vLLM's interpolate; our end-to-end time ends with the stream, vLLM's at its last token event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .record import Benchmark, Files, Progress

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {"ttft_p50": ("median_ttft_ms", ("streaming", "ttft_ms", "p50")),
           "ttft_p99": ("p99_ttft_ms", ("streaming", "ttft_ms", "p99")),
           "e2el_p50": ("median_e2el_ms", ("latency_ms", "p50")),
           "e2el_p99": ("p99_e2el_ms", ("latency_ms", "p99"))}
PLOT = "b6.png"
FILES = Files("bench-accuracy.json", "bench-accuracy.md", plots=(PLOT,))


@dataclass(frozen=True)
class RandomWorkload:
    """What both tools send (B6) and B1s sends down each path: random-token prompts of `input_len` tokens of the
    model's tokenizer, `output_len` tokens out (ignore_eos), streamed completions, `concurrency` in flight; `prompts`
    requests per `vllm bench serve` run (ours runs as long as vLLM's took), `seed` picks the prompts."""

    prompts: int
    concurrency: int
    input_len: int
    output_len: int
    seed: int = 0


def vllm_bench_serve(url: str, model: str, tokenizer: Path, out: Path, workload: RandomWorkload, *,
                     metrics: str = "ttft,e2el", failures_ok: bool = False) -> dict:
    """`vllm bench serve` (random-token prompts, ignore_eos, streamed completions) against `url`: its result JSON.
    Failed requests raise, unless `failures_ok` (the caller reports `result["failed"]`)."""
    from serve.vllm_server import DEFAULT_ENV

    w = workload
    argv = [str((ROOT / DEFAULT_ENV / "bin" / "vllm").absolute()), "bench", "serve",
            "--base-url", url, "--model", model, "--tokenizer", str(tokenizer.resolve()), "--dataset-name", "random",
            "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
            "--num-prompts", str(w.prompts), "--max-concurrency", str(w.concurrency), "--ignore-eos",
            "--seed", str(w.seed), "--percentile-metrics", metrics, "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(out.resolve()), "--result-filename", "result.json"]
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=out)
    (out / "vllm-bench.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
    result = json.loads((out / "result.json").read_text())
    if result.get("failed") and not failures_ok:
        raise RuntimeError(f"vllm bench serve: {result['failed']} failed requests")
    return result


def _ours(url: str, model: str, tokenizer: Path, out: Path, workload: RandomWorkload, duration_s: float) -> dict:
    from loadtest.runner import LoadSpec, run, scenario_options

    options = scenario_options(scenario="completions", model=model, workload="random", tokenizer=str(tokenizer),
                               input_len=workload.input_len, output_len=workload.output_len, seed=workload.seed)
    # No /metrics scraping: vllm bench serve does none, and on a small box serving /metrics costs the server time.
    summary = run(LoadSpec(url, options, users=workload.concurrency, duration_s=duration_s, warmup_s=0.0,
                           scrape_host=False), out, log=lambda m: None).summary
    if summary.errors:
        raise RuntimeError(f"rtxserve loadtest: {summary.errors} failed requests ({summary.error_kinds})")
    return summary.to_dict()


def _pick(data: dict, path: tuple) -> float:
    for key in path:
        data = data[key]
    return float(data)


def run(out: Path, *, url: str = "", model_dir: Path | None = None, served_name: str = "bench-llm", rounds: int = 3,
        prompts: int = 160, concurrency: int = 4, input_len: int = 64, output_len: int = 32, progress=print) -> dict:
    """Start vLLM on the fixture Llama (or use `url` serving `model_dir`'s model), run B6, write JSON + Markdown."""
    from contextlib import ExitStack

    from loadtest.report.pages import versions

    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if not url:
            from fixture_models.llm import write_llm
            from serve.stack import start_vllm
            from serve.vllm_server import VLLMOptions

            model_dir = model_dir or write_llm(out / "small-llama", shape="small")
            progress(f"starting vLLM for {model_dir} (log: {out / 'vllm.log'})")
            server, url = start_vllm(VLLMOptions(model=model_dir, served_name=served_name, max_model_len=512), out, timeout_s=900)
            stack.callback(server.stop)
        if model_dir is None:
            raise ValueError("--url needs --model (the served model's folder, for its tokenizer)")
        figures: dict[str, dict[str, list[float]]] = {"vllm": {k: [] for k in FIGURES}, "rtxserve": {k: [] for k in FIGURES}}
        duration = 10.0
        for r in range(rounds):
            order = ("vllm", "rtxserve") if r % 2 == 0 else ("rtxserve", "vllm")
            workload = RandomWorkload(prompts, concurrency, input_len, output_len, seed=r)
            for tool in order:
                where = out / f"round-{r + 1}" / tool
                if tool == "vllm":
                    result = vllm_bench_serve(url, served_name, model_dir, where, workload)
                    duration = max(5.0, float(result["duration"]))  # ours runs as long as vLLM's took
                    values = {k: float(result[v]) for k, (v, _) in FIGURES.items()}
                else:
                    summary = _ours(url, served_name, model_dir, where, workload, duration)
                    values = {k: _pick(summary, p) for k, (_, p) in FIGURES.items()}
                for k, v in values.items():
                    figures[tool][k].append(v)
                progress(f"  round {r + 1}/{rounds} {tool:<8} TTFT P50 {values['ttft_p50']:6.1f} P99 {values['ttft_p99']:6.1f} "
                         f"E2E P50 {values['e2el_p50']:6.1f} P99 {values['e2el_p99']:6.1f} ms")
    medians = {tool: {k: statistics.median(v) for k, v in f.items()} for tool, f in figures.items()}
    ratios = {k: medians["rtxserve"][k] / medians["vllm"][k] for k in FIGURES}
    result = {"id": "B6", "target": [0.9, 1.1], "ratios": ratios, "medians": medians, "rounds": figures,
              "within_target": all(0.9 <= v <= 1.1 for v in ratios.values()), "versions": versions(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "settings": {"prompts": prompts, "concurrency": concurrency, "input_len": input_len,
                           "output_len": output_len, "rounds": rounds, "ignore_eos": True, "stream": True}}
    return FILES.save(out, result, markdown, plot)


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(FIGURES)
    for offset, tool, colour in ((-0.2, "vllm", "tab:blue"), (0.2, "rtxserve", "tab:orange")):
        xs = [i + offset for i in range(len(names))]
        ax.bar(xs, [result["medians"][tool][n] for n in names], width=0.4, color=colour, alpha=0.7,
               label=f"{'vllm bench serve' if tool == 'vllm' else 'rtxserve loadtest'} (median)")
        for x, n in zip(xs, names):
            ax.scatter([x] * len(result["rounds"][tool][n]), result["rounds"][tool][n], color="black", s=10, zorder=3)
    ax.set_xticks(range(len(names)), [f"{n}\nratio {result['ratios'][n]:.2f}" for n in names])
    ax.set_ylabel("ms (bars: median; dots: rounds)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return save(fig, path, "B6: the same workload measured by both tools (target: every ratio 0.9-1.1)")


def markdown(result: dict) -> str:
    m, s = result["medians"], result["settings"]
    rows = "\n".join(f"| {k} | {m['vllm'][k]:.1f} | {m['rtxserve'][k]:.1f} | **{v:.3f}** |" for k, v in result["ratios"].items())
    return f"""# rtxserve bench accuracy (B6)

![both tools' figures, round by round]({PLOT})

`rtxserve loadtest` vs `vllm bench serve` on the same vLLM: random-token prompts of {s['input_len']} tokens,
{s['output_len']} output tokens (ignore_eos), {s['concurrency']} in flight, streamed completions; {s['rounds']}
interleaved rounds, medians (ms).

| figure | vllm bench serve | rtxserve loadtest | ratio |
|---|---|---|---|
{rows}

Target: every ratio within 0.9-1.1 ({"met" if result["within_target"] else "**not met**"}).
"""


# --- `rtxserve bench accuracy` --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="", help="a running vLLM server (default: start one on the fixture Llama)")
    parser.add_argument("--model", type=Path, help="with --url: the served model's folder (its tokenizer)")
    parser.add_argument("--served-name", default="bench-llm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=160,
                        help="requests per vllm bench serve round (P99 of fewer is about their maximum)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-accuracy-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or min(args.prompts, args.concurrency, args.input_len, args.output_len) < 1:
        return "need --rounds, --prompts, --concurrency, --input-len and --output-len >= 1"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, url=args.url.rstrip("/"), model_dir=args.model, served_name=args.served_name, rounds=args.rounds,
               prompts=args.prompts, concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
               progress=progress)


BENCHMARK = Benchmark(
    name="accuracy", id="B6", title="measurement accuracy",
    help="B6: rtxserve loadtest vs vllm bench serve on the same vLLM and workload",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

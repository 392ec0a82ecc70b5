"""`rtxserve bench promotion`: benchmark B15 (shared BENCH.md), a promotion under steady load on a CPU box.

Three runs, each with a real locust open loop through the real gateway for its whole length (a steady stretch first,
the promotion, a tail), and the real `rtxserve promote` beside it:
- a classifier v1 -> v2 on tritonserver (the fixture classifier and its second fine-tune; the gateway with two workers);
- an LLM adapter v1 -> v2 on vLLM, under streamed chats (the trained chat Llama and two LoRA versions of it);
- the classifier v1 -> a v2 made slow on purpose (each step of its entry waits for a batch), taken back.
Each request's start places it in a step of the promotion (from promote.json), or in the steady stretch before it. B15
is each step's users' P99 (TTFT for the streams) against the steady stretch's (target <= 1.2x), the failed requests
(target 0, no stream cut) and the seconds each step took.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from core.machine import machine

from .record import Benchmark, Files, Progress

PLOT = "b15.png"
FILES = Files("bench-promotion.json", "bench-promotion.md", plots=(PLOT,))
TARGET_P99 = 1.2
WARMUP_S = 10.0  # the load's first seconds (the engines' first requests), left out of the steady stretch


def _admin_key(folder: Path) -> tuple[Path, str]:
    from serve.gateway.access.keys_cli import main as keys_main

    keys, out = folder / "keys.json", io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        if keys_main(["--keys", str(keys), "create", "--name", "ops", "--admin"]) != 0:
            raise RuntimeError("could not make an admin key")
    return keys, out.getvalue().strip()


@contextlib.contextmanager
def _classifiers(work: Path, progress: Progress):
    """tritonserver with the fixture classifier (reviews), its second fine-tune (reviews-v2) and that made slow
    (reviews-slow), behind a gateway with two workers, keys and a rollout file: (URL, key, repository)."""
    from export.encoders.encoder import export_text_classification
    from export.triton.entry import EntryOptions
    from fixture_models.text import write_text_classifier, write_text_classifier_v2
    from serve.stack import start_gateway, start_triton

    progress("training the fixture classifier and its second fine-tune; exporting them")
    v1 = write_text_classifier(work / "v1")
    v2 = write_text_classifier_v2(v1, work / "v2")
    for name, checkpoint, options in (("reviews", v1, {}), ("reviews-v2", v2, {}),
                                      ("reviews-slow", v2, {"max_queue_delay_us": 500_000})):
        export_text_classification(checkpoint, EntryOptions(name=name, **options), work / "repo")
    keys, key = _admin_key(work)
    triton, opts = start_triton(work / "repo", work / "logs")
    try:
        gateway, url = start_gateway(f"127.0.0.1:{opts.grpc_port}", work / "logs", workers=2, extra_env={
            "RTXSERVE_KEYS_FILE": str(keys), "RTXSERVE_ROLLOUT_FILE": str(work / "rollout.json")})
        try:
            yield url, key, work / "repo"
        finally:
            gateway.stop()
    finally:
        triton.stop()


@contextlib.contextmanager
def _adapters(work: Path, progress: Progress):
    """vLLM with the trained chat Llama and its adapters support-v1 and support-v2 (each packaged with its reference
    set), behind a gateway with keys and a rollout file: (URL, key, the packages' folder)."""
    from export.llm.llm import LLMOptions, export_llm
    from fixture_models.llm import adapter_answers, write_chat_adapter, write_chat_llm
    from serve.stack import start_gateway, start_vllm
    from serve.vllm_server import TWO_PROCESSES, VLLMOptions

    progress("training the chat Llama and two adapter versions; packaging them")
    base = write_chat_llm(work / "chat-llm")
    for version in (1, 2):
        questions = work / f"v{version}.jsonl"
        questions.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}) + "\n"
                                     for q, a in adapter_answers(version).items()))
        export_llm(write_chat_adapter(base, work / f"adapter-v{version}", version), work / f"support-v{version}",
                   LLMOptions(eval_set=questions))
    keys, key = _admin_key(work)
    vllm, vllm_url = start_vllm(VLLMOptions(model=base, served_name="chat-llm", max_model_len=512, adapters={
        f"support-v{v}": work / f"support-v{v}" for v in (1, 2)}, extra_args=["--enforce-eager"]), work, env=TWO_PROCESSES)
    try:
        gateway, url = start_gateway("", work, vllm_url=vllm_url, extra_env={
            "RTXSERVE_KEYS_FILE": str(keys), "RTXSERVE_ROLLOUT_FILE": str(work / "rollout.json")})
        try:
            yield url, key, work
        finally:
            gateway.stop()
    finally:
        vllm.stop()


def _promote_under_load(url: str, key: str, load_options: dict, promote_args: list[str], *, steady_s: float,
                        tail_s: float, folder: Path, progress: Progress) -> dict:
    """A locust open loop for steady_s, the promotion, then tail_s; the promotion's report and the load's samples."""
    from loadtest.report.report import load_samples
    from loadtest.runner import LoadSpec, run

    stop = threading.Event()
    started = time.time()
    thread = threading.Thread(target=lambda: run(LoadSpec(url, load_options, users=4, duration_s=3600, warmup_s=0),
                                                 folder / "load", log=lambda *_: None,
                                                 stop_early=lambda row: "done" if stop.is_set() else ""))
    thread.start()
    try:
        time.sleep(WARMUP_S + steady_s)
        progress(f"promoting: rtxserve promote {' '.join(promote_args)}")
        done = subprocess.run([sys.executable, "-m", "rtxserve.cli", "promote", url, "--api-key", key, "--out",
                               str(folder / "promote"), *promote_args], capture_output=True, text=True, timeout=900)
        progress(done.stdout.strip().splitlines()[0] if done.stdout.strip() else done.stderr.strip()[-300:])
        time.sleep(tail_s)
    finally:
        stop.set()
        thread.join()
    report = json.loads((folder / "promote" / "promote.json").read_text())
    return _by_step(report, load_samples(folder / "load" / "samples.csv"), started, done.returncode)


def _by_step(report: dict, samples, started: float, code: int) -> dict:
    """Each request placed by its start in the steady stretch, a step of the promotion, or the tail: per stretch its
    seconds, requests, failures, P50 / P99 (ms; a stream's TTFT) and P99 against the steady stretch's."""
    steps = [(s["name"], s["started"], s["seconds"]) for s in report["steps"]]
    bounds = [("warm-up", started, started + WARMUP_S), ("steady", started + WARMUP_S, steps[0][1])]
    bounds += [(name, t0, t0 + secs) for name, t0, secs in steps]
    bounds.append(("after", bounds[-1][2], float("inf")))
    streamed = samples.streamed
    value = np.where(streamed, samples.ttft_ms, samples.latency_ms) if streamed.any() else samples.latency_ms
    out = []
    for name, t0, t1 in bounds:
        mine = (samples.start >= t0) & (samples.start < t1)
        if not mine.any():  # a step of no time (the load of a model already loaded)
            continue
        ok = mine & samples.ok
        figures = {"step": name, "seconds": round(min(t1, samples.end.max()) - t0, 1), "requests": int(mine.sum()),
                   "failed": int((mine & ~samples.ok).sum())}
        if ok.sum():
            figures |= {"p50_ms": round(float(np.percentile(value[ok], 50)), 1),
                        "p99_ms": round(float(np.percentile(value[ok], 99)), 1)}
        out.append(figures)
    steady = next(f for f in out if f["step"] == "steady").get("p99_ms")
    for f in out:
        if steady and "p99_ms" in f:
            f["p99_vs_steady"] = round(f["p99_ms"] / steady, 2)
    return {"result": report["result"], "reason": report["reason"], "exit": code, "streamed": bool(streamed.any()),
            "failed": int((~samples.ok).sum()), "requests": len(samples.ok), "steps": out}


def run(out: Path, *, rate: float = 20.0, chat_rate: float = 4.0, steady_s: float = 20.0, step_s: float = 15.0,
        progress: Progress = print) -> dict:
    from loadtest.runner import scenario_options

    out.mkdir(parents=True, exist_ok=True)
    steps = ["--shadow-seconds", str(step_s), "--step-seconds", str(step_s), "--rollback-window", str(step_s)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="rtxserve-b15-") as tmp:
        with _classifiers(Path(tmp) / "triton", progress) as (url, key, repo):
            load = scenario_options(scenario="classify", model="reviews", api_key=key, arrival="poisson", rate=rate)
            for name, candidate, extra in (("classifier", "reviews-v2", []), ("slow", "reviews-slow", ["--shadow-share", "0"])):
                progress(f"B15 {name}: reviews -> {candidate} under {rate:g} req/s")
                refs = ["--candidate-reference", str(repo / candidate), "--current-reference", str(repo / "reviews")]
                results[name] = _promote_under_load(url, key, load, ["--model", "reviews", "--to", candidate, *refs,
                                                                     *steps, *extra],
                                                    steady_s=steady_s, tail_s=5, folder=out / name, progress=progress)
        with _adapters(Path(tmp) / "vllm", progress) as (url, key, packages):
            load = scenario_options(scenario="chat", model="support-v1", api_key=key, arrival="poisson", rate=chat_rate,
                                    output_len=16)
            progress(f"B15 adapter: support-v1 -> support-v2 under {chat_rate:g} streamed chats/s")
            refs = ["--candidate-reference", str(packages / "support-v2"), "--current-reference",
                    str(packages / "support-v1")]
            results["adapter"] = _promote_under_load(url, key, load, ["--model", "support-v1", "--to", "support-v2",
                                                                      *refs, *steps, "--min-requests", "10"],
                                                     steady_s=steady_s, tail_s=5, folder=out / "adapter",
                                                     progress=progress)
    result = {"bench": "B15", "cpu": machine(), "rate": rate, "chat_rate": chat_rate, "steady_s": steady_s,
              "step_s": step_s, "target_p99": TARGET_P99, "runs": results}
    return FILES.save(out, result, markdown, plot)


def markdown(result: dict) -> str:
    lines = [f"""# B15: a promotion under steady load

![each step's users' P99 against the steady stretch's]({PLOT})

The real `rtxserve promote` beside a real locust open loop through the real gateway: the fixture classifier v1 -> v2
on tritonserver at {result['rate']:g} req/s (two gateway workers), the chat Llama's adapter v1 -> v2 on vLLM at
{result['chat_rate']:g} streamed chats/s (P50 / P99: time to first token), and v1 -> a v2 made slow on purpose. Steps of
{result['step_s']:g} s after {WARMUP_S:g} s of warm-up and {result['steady_s']:g} s of steady load; each request placed by its
start. Targets: 0
failed, no stream cut; each step's P99 <= {result['target_p99']}x the steady stretch's. CPU: {result['cpu']}.
"""]
    for name, run_ in result["runs"].items():
        worst = max((s.get("p99_vs_steady", 0) for s in run_["steps"] if s["step"] not in ("warm-up", "steady", "after")),
                    default=0)
        lines += [f"## {name}: {run_['result']}" + (f" ({run_['reason']})" if run_["reason"] else ""), "",
                  f"{run_['requests']} requests, **{run_['failed']} failed**; the worst step's P99 "
                  f"**{worst}x** steady (target <= {result['target_p99']}x).", "",
                  "| stretch | s | requests | failed | P50 ms | P99 ms | P99 / steady |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {s['step']} | {s['seconds']} | {s['requests']} | {s['failed']} | {s.get('p50_ms', '-')} | "
                  f"{s.get('p99_ms', '-')} | {s.get('p99_vs_steady', '-')} |" for s in run_["steps"]]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (name, run_) in zip(axes[0], runs.items()):
        steps = [s for s in run_["steps"] if s["step"] != "warm-up"]
        ratios = [s.get("p99_vs_steady", 0) for s in steps]
        colours = ["tab:gray" if i == 0 else "tab:red" if s["failed"] or r > result["target_p99"] else "tab:green"
                   for i, (s, r) in enumerate(zip(steps, ratios))]
        ax.bar(range(len(steps)), ratios, color=colours)
        ax.axhline(result["target_p99"], color="black", linestyle="--", label=f"target {result['target_p99']}x")
        for i, s in enumerate(steps):
            if s["failed"]:
                ax.annotate(f"{s['failed']} failed", (i, ratios[i]), ha="center", va="bottom", color="tab:red", fontsize=8)
        ax.set_xticks(range(len(steps)), [s["step"] for s in steps], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("users' P99 / steady stretch's" + (" (TTFT)" if run_["streamed"] else ""))
        ax.set_title(f"{name}: {run_['result']}, {run_['failed']} failed", fontsize=9)
        ax.legend(fontsize=8)
    return save(fig, path, "B15: users' P99 in each step of a promotion against steady load")


# --- `rtxserve bench promotion` -------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=20.0, help="classify requests per second (open loop)")
    parser.add_argument("--chat-rate", type=float, default=4.0, help="streamed chats per second (open loop)")
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of steady load before each promotion")
    parser.add_argument("--step", type=float, default=15.0, help="seconds per shadow, canary and rollback-window step")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-promotion-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if min(args.rate, args.chat_rate, args.steady, args.step) <= 0:
        return "need --rate, --chat-rate, --steady and --step > 0"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rate=args.rate, chat_rate=args.chat_rate, steady_s=args.steady, step_s=args.step, progress=progress)


BENCHMARK = Benchmark(
    name="promotion", id="B15", title="a promotion under steady load",
    help="B15: users' P99 and failed requests in each step of rtxserve promote, against steady load",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

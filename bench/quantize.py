"""`rtxserve bench quantize`: benchmark B8 (shared BENCH.md), quantised LLMs against the unquantised one.

The B4 model (the "small" Llama fixture, 58M parameters, float32) is quantised with each scheme by `rtxserve export
llm --quantize` (llm-compressor), whose accuracy report gives the perplexity delta, top-1 agreement and mean KL
against the unquantised model on held-out prompts; bfloat16 is measured the same way, in-process. Each form is then
served by the real vLLM (compiled, as a deployment runs it), one after another, and B4's closed loop measures output
tokens/s with 1 and 16 streams (ignore_eos, not streamed), interleaved over rounds; figures are medians. Sizes are the
weights as stored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from core.machine import machine

from .record import Benchmark, Files, Progress

SCHEMES = ("w4a16", "w8a8-int8", "w8a8-fp8")
TARGETS = {"w4a16": 0.05, "w8a8-int8": 0.01, "w8a8-fp8": 0.01}  # BENCH.md: ppl increase <= 5 % (w8a8 <= 1 %)
STREAMS = (1, 16)
PLOT = "b8.png"
FILES = Files("bench-quantize.json", "bench-quantize.md", plots=(PLOT,))


def _bf16_accuracy(model: Path) -> dict:
    """bfloat16 against float32, measured as the quantised schemes are (the same held-out prompts and figures)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export.llm.llmcompressor_runner import _accuracy, _reference_pass, _token_ids
    from export.llm.quantize import HELD_OUT, PROMPTS, _render

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = _token_ids(tokenizer, [_render(tokenizer, p, "built-in prompt") for p in PROMPTS[-HELD_OUT:]], 512)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        table, nll = _reference_pass(reference, ids, Path(tmp) / "reference-logprobs.npy")
        del reference
        bf16 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        return _accuracy(table, nll, bf16, ids)


def _throughput(model: Path, dtype: str, work: Path, rounds: int, duration_s: float, max_tokens: int,
                progress) -> dict[int, list[float]]:
    from serve.stack import start_vllm
    from serve.vllm_server import VLLMOptions

    from .llm import closed_loop, prompts_for

    server, url = start_vllm(VLLMOptions(model=model, served_name="b8", max_model_len=512, kv_cache_gib=2, dtype=dtype),
                             work, timeout_s=900)
    try:
        prompts = prompts_for()
        asyncio.run(closed_loop(url, "b8", max(STREAMS), 3.0, max_tokens, prompts))  # warm-up
        runs: dict[int, list[float]] = {n: [] for n in STREAMS}
        for r in range(rounds):
            for n in (STREAMS if r % 2 == 0 else tuple(reversed(STREAMS))):
                runs[n].append(asyncio.run(closed_loop(url, "b8", n, duration_s, max_tokens, prompts))["tokens_per_s"])
                progress(f"  round {r + 1}/{rounds}: {n:>2} stream(s) {runs[n][-1]:8.1f} output tokens/s")
        return runs
    finally:
        server.stop()


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def run(out: Path, *, rounds: int = 3, duration_s: float = 6.0, max_tokens: int = 64, progress=print) -> dict:
    from fixture_models.llm import write_llm
    from export.llm.llm import LLMOptions, export_llm

    out.mkdir(parents=True, exist_ok=True)
    forms: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rtxserve-b8-") as tmp:
        work = Path(tmp)
        progress("writing the B4 model (the small Llama fixture, 58M parameters, float32)")
        base = write_llm(work / "small-llama", shape="small")
        forms["float32"] = {"path": base, "dtype": "float32", "size": _size(base), "accuracy": None}
        progress("bfloat16: measuring it against float32")
        forms["bfloat16"] = {"path": base, "dtype": "bfloat16", "size": _size(base) // 2, "accuracy": _bf16_accuracy(base)}
        for scheme in SCHEMES:
            progress(f"{scheme}: quantising with llm-compressor and measuring it")
            done = export_llm(base, work / scheme, LLMOptions(quantize=scheme, allow_drift=True))
            parity = json.loads((done.out / "parity.json").read_text())["quantization"]
            forms[scheme] = {"path": done.out, "dtype": "auto", "size": _size(done.out),
                             "accuracy": {k: parity[k] for k in ("tokens", "perplexity", "perplexity_increase",
                                                                 "top1_agreement", "mean_kl")}}
        for name, form in forms.items():
            progress(f"{name}: output tokens/s through vLLM, {rounds} interleaved rounds of {duration_s:g} s")
            form["tokens_per_s"] = _throughput(form["path"], form["dtype"], work / f"logs-{name}", rounds, duration_s,
                                               max_tokens, progress)
    result = {"bench": "B8", "cpu": machine(), "rounds": rounds, "duration_s": duration_s, "max_tokens": max_tokens,
              "model": "the small Llama fixture (58M parameters, float32), B4's model", "forms": {
                  name: {"size_bytes": f["size"], "accuracy": f["accuracy"], "target": TARGETS.get(name),
                         "tokens_per_s": {str(n): statistics.median(v) for n, v in f["tokens_per_s"].items()},
                         "rounds": {str(n): v for n, v in f["tokens_per_s"].items()}}
                  for name, f in forms.items()}}
    return FILES.save(out, result, markdown, plot)


def markdown(result: dict) -> str:
    fp32 = result["forms"]["float32"]
    rows = []
    for name, f in result["forms"].items():
        a, target = f["accuracy"], f["target"]
        accuracy = ("reference", "", "") if a is None else (
            f"{a['perplexity_increase']:+.2%}" + (f" (target ≤ {target:.0%}: {'met' if a['perplexity_increase'] <= target else 'NOT met'})"
                                                  if target is not None else ""),
            f"{a['top1_agreement']:.1%}", f"{a['mean_kl']:.2g}")
        one, sixteen = f["tokens_per_s"]["1"], f["tokens_per_s"]["16"]
        rows.append(f"| {name} | {f['size_bytes'] / 1e6:.1f} MB ({f['size_bytes'] / fp32['size_bytes']:.2f}x) | "
                    f"{' | '.join(accuracy)} | {one:.0f} ({one / fp32['tokens_per_s']['1']:.2f}x) | "
                    f"{sixteen:.0f} ({sixteen / fp32['tokens_per_s']['16']:.2f}x) |")
    return f"""# B8: quantised LLMs against the unquantised one

![Output tokens/s at 1 and 16 streams, and the perplexity each form costs]({PLOT})

{result['model']}, quantised by `rtxserve export llm --quantize` (llm-compressor; accuracy measured through
transformers' compressed-tensors loader on the held-out built-in prompts; bfloat16 measured the same way) and served by
vLLM on this CPU, one form after another; tokens/s is B4's closed loop (ignore_eos, {result['max_tokens']} tokens, not
streamed), median of {result['rounds']} interleaved rounds x {result['duration_s']:g} s. CPU: {result['cpu']}.

| form | weights as stored | perplexity vs float32 | top-1 agreement | mean KL | tokens/s, 1 stream | tokens/s, 16 streams |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

bfloat16 is the float32 checkpoint cast by vLLM as it loads (its size: what vLLM holds). The model is barely trained
(a fixture): the accuracy columns say each path works and what it moves, not what a real fine-tune loses; on a real
model, measure with your own data (`--calibration`, `--eval`).
"""


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    names = list(result["forms"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for offset, n in ((-0.2, "1"), (0.2, "16")):
        left.bar([i + offset for i in range(len(names))], [result["forms"][k]["tokens_per_s"][n] for k in names],
                 width=0.4, label=f"{n} stream(s), median")
        for i, k in enumerate(names):
            rounds = result["forms"][k]["rounds"][n]
            left.scatter([i + offset] * len(rounds), rounds, color="black", s=8, zorder=3)
    left.set_xticks(range(len(names)), names, rotation=15)
    left.set_ylabel("output tokens / s")
    left.legend(fontsize=8)
    increases = [100 * (result["forms"][k]["accuracy"] or {"perplexity_increase": 0})["perplexity_increase"] for k in names]
    right.bar(range(len(names)), increases, color="tab:orange")
    for i, k in enumerate(names):
        if result["forms"][k]["target"] is not None:
            right.hlines(100 * result["forms"][k]["target"], i - 0.4, i + 0.4, colors="tab:red", linestyles="--")
    right.set_xticks(range(len(names)), names, rotation=15)
    right.set_ylabel("perplexity increase vs float32 (%); dashed: target")
    fastest = max(names, key=lambda k: result["forms"][k]["tokens_per_s"]["16"])
    return save(fig, path, f"B8: quantised forms of the B4 model; fastest at 16 streams: {fastest}")


# --- `rtxserve bench quantize` --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per stream level, form and round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-quantize-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.duration <= 0 or args.max_tokens < 2:
        return "need --rounds >= 1, --duration > 0 and --max-tokens >= 2"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rounds=args.rounds, duration_s=args.duration, max_tokens=args.max_tokens, progress=progress)


BENCHMARK = Benchmark(
    name="quantize", id="B8", title="quantised LLMs",
    help="B8: the B4 model quantised with each scheme (llm-compressor) against float32 and bfloat16: perplexity, size, "
         "output tokens/s at 1 and 16 streams through vLLM",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

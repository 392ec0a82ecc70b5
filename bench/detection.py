"""`rtxserve bench detection`: benchmark B7 (shared BENCH.md), what the export of an Ultralytics detector buys on
this CPU, and what INT8 costs in accuracy.

Speed: a yolo11s-shaped model (Ultralytics builds it from its YAML, random weights) at 640x640, batch 1, exported by
`rtxserve export detection` at fp32 and at int8; PyTorch eager is Ultralytics' own predictor model run in its
environment (a process per round, its median over the round's calls), the two ONNX Runtime forms in this process,
on the same letterboxed tensor with the same threads, interleaved over rounds (rotating the order), medians.
Accuracy: the fixture YOLO11n (trained here from random weights on generated rectangles) and its fp32 and int8
exports, each scored by Ultralytics' own validator (box mAP@0.5 and @0.5:0.95) on a generated validation set.
Targets: ONNX Runtime FP32 >= 1.3x eager, INT8 >= 2x with an mAP@0.5 drop <= 0.01.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from core.machine import machine

from .export import latency_bars, median_ms
from .record import Benchmark, Files, Progress

FORMS = ("pytorch eager", "onnxruntime fp32", "onnxruntime int8")
TARGETS = {"onnxruntime fp32": 1.3, "onnxruntime int8": 2.0, "int8 map50 drop": 0.01}
PLOT = "b7.png"
FILES = Files("bench-detection.json", "bench-detection.md", plots=(PLOT,))


def _export(weights: Path, repo: Path, name: str, precision: str, images: list[bytes] | None = None) -> Path:
    from core.tasks import OBJECT_DETECTION
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.triton.entry import EntryOptions

    export_encoder(weights, OBJECT_DETECTION, EntryOptions(name=name), repo,
                   EncoderOptions(precision=precision, sample_images=images))
    return repo / f"{name}_model" / "1" / "model.onnx"


def run(out: Path, *, rounds: int = 3, iterations: int = 10, threads: int | None = None, yaml: str = "yolo11s.yaml",
        val_images: int = 64, progress=print) -> dict:
    import onnxruntime as ort

    from export.triton.python_models.image_preprocess import imaging
    from export.detection.yolo import run_in_ultralytics
    from fixture_models.detection import write_yolo

    threads = threads or os.cpu_count() or 1
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-detection-", dir=out) as work:
        work = Path(work)
        progress(f"building {yaml} (random weights) and exporting it at fp32 and int8")
        weights = work / "speed.pt"
        run_in_ultralytics("build", {"yaml": yaml, "out": str(weights)}, work)
        graphs = {form: _export(weights, work / "repo", form.split()[-1], form.split()[-1]) for form in FORMS[1:]}
        rng = np.random.default_rng(0)
        image = rng.integers(0, 256, (640, 640, 3), dtype=np.uint8)
        tensor = imaging.letterbox(image, 640, 32)[None]
        np.save(work / "input.npy", tensor)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        sessions = {form: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                    for form, path in graphs.items()}
        torch_version = ""

        def eager() -> float:
            nonlocal torch_version
            found = run_in_ultralytics("time", {"weights": str(weights), "input": str(work / "input.npy"),
                                                "iterations": iterations, "threads": threads}, work / "eager")
            torch_version = found["torch"]
            return found["median_ms"]

        measure = {"pytorch eager": eager, **{form: (lambda s=s: median_ms(lambda: s.run(["output0"], {"images": tensor}),
                                                                          iterations)) for form, s in sessions.items()}}
        for session in sessions.values():  # warm-up
            median_ms(lambda: session.run(["output0"], {"images": tensor}), 2)
        per_round: dict[str, list[float]] = {form: [] for form in FORMS}
        for r in range(rounds):
            for form in FORMS[r % len(FORMS):] + FORMS[: r % len(FORMS)]:
                per_round[form].append(measure[form]())
            progress(f"  round {r + 1}/{rounds}: " + ", ".join(f"{f} {per_round[f][-1]:.1f} ms" for f in FORMS))
        sizes = {"pytorch eager": weights.stat().st_size, **{f: p.stat().st_size for f, p in graphs.items()}}

        progress(f"training the fixture YOLO11n ({val_images} validation images) and scoring it and its exports "
                 "with Ultralytics' validator")
        run = write_yolo(work / "fixture", val_images=val_images)
        samples = [p.read_bytes() for p in sorted((run.parent / "data" / "images" / "train").glob("*.png"))]
        scored = {"pytorch eager": run / "weights" / "best.pt",
                  **{form: _export(run / "weights" / "best.pt", work / "fixture-repo", form.split()[-1],
                                   form.split()[-1], samples) for form in FORMS[1:]}}
        found = run_in_ultralytics("val", {"models": [str(p) for p in scored.values()],
                                           "data": str(run.parent / "data.yaml"), "imgsz": 128}, work / "val-work")
        accuracy = {form: found[str(path)] for form, path in scored.items()}

    medians = {form: statistics.median(v) for form, v in per_round.items()}
    result = {
        "id": "B7", "cpu": machine(), "model": f"{yaml} (random weights), 640x640, batch 1", "threads": threads, "rounds": rounds,
        "iterations_per_round": iterations, "median_ms": medians, "per_round_ms": per_round,
        "speedup_vs_eager": {f: medians["pytorch eager"] / v for f, v in medians.items()},
        "size_bytes": sizes, "accuracy_model": f"fixture YOLO11n at 128, {val_images} generated validation images",
        "accuracy": accuracy, "map50_drop_int8": accuracy["pytorch eager"]["map50"] - accuracy["onnxruntime int8"]["map50"],
        "targets": TARGETS, "versions": {"torch (Ultralytics' environment)": torch_version, "onnxruntime": ort.__version__},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return FILES.save(out, result, markdown, plot)


def markdown(result: dict) -> str:
    rows = [f"| {f} | {result['median_ms'][f]:.1f} | {result['speedup_vs_eager'][f]:.2f}x | "
            f"{result['size_bytes'][f] / 1e6:.1f} | {result['accuracy'][f]['map50']:.4f} | "
            f"{result['accuracy'][f]['map50_95']:.4f} |" for f in FORMS]
    return "\n".join([
        "# rtxserve bench detection (B7)", "",
        f"CPU: {result.get('cpu', '?')}.", "",
        f"Speed: {result['model']}, {result['threads']} thread(s), median over {result['rounds']} interleaved rounds of "
        f"{result['iterations_per_round']} calls. Accuracy: {result['accuracy_model']}, Ultralytics' validator. "
        f"{', '.join(f'{k} {v}' for k, v in result['versions'].items())}.", "",
        f"![latency and mAP by form]({PLOT})", "",
        "| form | latency ms (median) | vs PyTorch eager | file MB | mAP@0.5 | mAP@0.5:0.95 |", "|---|---|---|---|---|---|",
        *rows, "",
        f"mAP@0.5 drop at int8: {result['map50_drop_int8']:+.4f}. Targets: ONNX Runtime FP32 >= "
        f"{TARGETS['onnxruntime fp32']}x, INT8 >= {TARGETS['onnxruntime int8']}x with an mAP@0.5 drop <= "
        f"{TARGETS['int8 map50 drop']}. (PyTorch eager's file is Ultralytics' checkpoint, saved in fp16.)", "",
    ])


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, (speed, acc) = plt.subplots(1, 2, figsize=(11, 4.5))
    latency_bars(speed, result)
    speed.set_xlabel("latency per image, ms (bar: median over rounds; dots: each round)")
    speed.set_title(result["model"], fontsize=9)
    acc.barh(FORMS, [result["accuracy"][f]["map50"] for f in FORMS], color="tab:green", alpha=0.6, label="mAP@0.5")
    acc.barh(FORMS, [result["accuracy"][f]["map50_95"] for f in FORMS], color="tab:green", alpha=0.9,
             label="mAP@0.5:0.95", height=0.4)
    for i, f in enumerate(FORMS):
        acc.text(result["accuracy"][f]["map50"], i, f"  {result['accuracy'][f]['map50']:.3f}", va="center")
    acc.invert_yaxis()
    acc.set_xlim(0, 1)
    acc.set_yticklabels([])
    acc.set_xlabel("box mAP (Ultralytics' validator)")
    acc.set_title(result["accuracy_model"], fontsize=9)
    acc.legend(loc="lower right", fontsize=8)
    return save(fig, path, "B7: Ultralytics YOLO, PyTorch eager vs the exported graph")


# --- `rtxserve bench detection` -------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10, help="calls per form and round")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for PyTorch and ONNX Runtime (default: all cores)")
    parser.add_argument("--model", default="yolo11s.yaml", help="the Ultralytics model YAML timed (random weights)")
    parser.add_argument("--val-images", type=int, default=64, help="generated validation images the mAP is scored on")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-detection-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if args.rounds < 1 or args.iterations < 1 or args.val_images < 1 or (args.threads is not None and args.threads < 1):
        return "need --rounds, --iterations, --val-images (and --threads) >= 1"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rounds=args.rounds, iterations=args.iterations, threads=args.threads, yaml=args.model,
               val_images=args.val_images, progress=progress)


BENCHMARK = Benchmark(
    name="detection", id="B7", title="object detection",
    help="B7: PyTorch eager vs ONNX Runtime FP32 / INT8 on a yolo11s-shaped model at 640, and the mAP the exports keep "
         "(Ultralytics' validator, the fixture YOLO)",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

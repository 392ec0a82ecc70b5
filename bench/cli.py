"""`rtxserve bench NAME`: a sub-command per benchmark record (bench/registry.py); each parses, checks and runs its
record, and the work is in the module of the same name under bench/."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

from .registry import BENCHMARKS, BY_NAME


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtxserve bench", description="Benchmarks that print and save their figures.")
    sub = parser.add_subparsers(dest="bench", required=True)
    for benchmark in BENCHMARKS:
        benchmark.add_arguments(sub.add_parser(benchmark.name, help=benchmark.help))
    return parser


def _fail(message: str) -> int:
    print(f"rtxserve bench: error: {message}", file=sys.stderr)
    return 2


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    benchmark = BY_NAME[args.bench]
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    error = benchmark.validate(args)
    if error:  # before anything starts
        return _fail(error)
    out = args.out or Path("reports") / f"bench-{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    from export.exceptions import ExportError

    try:
        result = benchmark.run(args, out, _progress)
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired, ExportError) as exc:
        return _fail(str(exc))
    print(benchmark.markdown(result))
    print("saved: " + ", ".join(str(out / name) for name in benchmark.files if (out / name).exists()))
    return 0

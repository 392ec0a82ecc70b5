"""`rtxserve demo` (what `make demo` runs): the whole path on CPU, end to end, with real servers.

fixtures -> export (ONNX, parity) -> tritonserver + gateway -> locust -> report headline -> stop.
Everything lands in one work folder (default .rtxserve/demo); rerunning replaces it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path


def _say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtxserve demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".rtxserve/demo"))
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--instances", type=int, default=1, help="model instances in Triton")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polls are not news

    from export.classifier import export_text_classification
    from export.fixtures import write_text_classifier
    from export.triton_entry import EntryOptions
    from loadtest.report import headline
    from loadtest.runner import run
    from serve.launcher import ServerStartError
    from serve.stack import start_stack

    work = args.workdir.resolve()
    name = "demo_classifier"
    _say(f"1/4 writing a fine-tuned-style BERT classifier checkpoint to {work / 'checkpoint'}")
    checkpoint = write_text_classifier(work / "checkpoint")
    _say("2/4 exporting it to ONNX (validated against PyTorch) and a Triton ensemble")
    repository = work / "model_repository"
    export_text_classification(
        checkpoint, EntryOptions(name=name, instances=args.instances), repository, force=True,
        command=f"rtxserve export onnx {checkpoint} --task text-classification --name {name} --repository {repository} --force",
    )
    _say("3/4 starting tritonserver and the gateway")
    try:
        stack = start_stack(repository, work / "logs")
    except ServerStartError as exc:
        _say(f"error: {exc}")
        return 1
    with stack:
        _say(f"gateway ready at {stack.gateway_url} (tritonserver gRPC {stack.triton_grpc_url})")
        _say(f"4/4 load test: {args.users} users for {args.duration:g}s")
        result = run("classify", stack.gateway_url, work / "report", users=args.users, duration_s=args.duration,
                     warmup_s=args.warmup, env={"RTXSERVE_MODEL": name}, log=_say)
        _say("stopping servers")
    print()
    print(f"rtxserve demo: {headline(result.summary)}")
    print(f"report: {result.report} (plot: {result.out_dir / 'latency.png'})")
    return 0 if result.summary.errors == 0 and result.summary.qps > 0 else 1

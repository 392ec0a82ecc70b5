"""`rtxserve loadtest run|report`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtxserve loadtest", description="Load-test the gateway with locust.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a scenario headless and write a report (Markdown + PNG + JSON)")
    r.add_argument("--scenario", default="classify",
                   help="classify (POST /v1/classify) or chat (streamed /v1/chat/completions); default %(default)s")
    r.add_argument("--host", default=os.environ.get("RTXSERVE_GATEWAY_URL", "http://127.0.0.1:8080"),
                   help="gateway URL (env RTXSERVE_GATEWAY_URL; default %(default)s)")
    r.add_argument("--model", required=True, help="model name the requests ask for")
    r.add_argument("--batch", type=int, default=1, help="classify: texts per request")
    r.add_argument("--max-tokens", type=int, default=64, help="chat: max_tokens of each request (default %(default)s)")
    r.add_argument("--prompt-words", default="4,120", metavar="MIN,MAX",
                   help="chat: words in each prompt, drawn uniformly (default %(default)s)")
    r.add_argument("--users", type=int, default=8, help="concurrent closed-loop users")
    r.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    r.add_argument("--duration", type=float, default=30.0, help="seconds of load, warm-up included")
    r.add_argument("--warmup", type=float, default=5.0, help="seconds excluded from the figures")
    r.add_argument("--out", type=Path, default=None, help="report folder (default reports/<scenario>-<time>)")
    p = sub.add_parser("report", help="recompute the report from a run folder's raw samples")
    p.add_argument("folder", type=Path)
    p.add_argument("--warmup", type=float, default=5.0)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from .report import headline, load_samples, summarize, write_report

        samples = load_samples(args.folder / "samples.csv")
        if not len(samples.end):
            print(f"rtxserve loadtest: error: no samples in {args.folder}", file=sys.stderr)
            return 2
        summary = summarize(samples, args.warmup)
        path = write_report(summary, samples, args.folder, f"rtxserve load test ({args.folder.name})")
        print(f"{headline(summary)}\nreport: {path}")
        return 0
    from .runner import run

    # Each scenario is given only its own knobs, so that the report's settings list what applied.
    knobs = {"classify": {"RTXSERVE_BATCH": str(args.batch)},
             "chat": {"RTXSERVE_MAX_TOKENS": str(args.max_tokens), "RTXSERVE_PROMPT_WORDS": args.prompt_words}}
    out = args.out or Path("reports") / f"{args.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        result = run(args.scenario, args.host, out, users=args.users, spawn_rate=args.spawn_rate,
                     duration_s=args.duration, warmup_s=args.warmup,
                     env={"RTXSERVE_MODEL": args.model, **knobs.get(args.scenario, {})},
                     log=lambda m: print(m, file=sys.stderr))
    except (ValueError, RuntimeError) as exc:
        print(f"rtxserve loadtest: error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {result.report}")
    return 0 if result.summary.errors == 0 else 1

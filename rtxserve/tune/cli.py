"""`rtxserve tune triton|vllm`: search a server's knobs for the configuration that holds the most load within an
SLO (the package's doc says how)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .run import tune
from .search import MEASURES, Search
from .targets import TritonTarget, VLLMTarget


def _values(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise ValueError(f"--{what}: expected comma-separated whole numbers, not {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from loadtest.runner import scenario_parser

    parser = argparse.ArgumentParser(prog="rtxserve tune", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="target", required=True)
    t = sub.add_parser("triton", help="instances x max_batch_size x queue delay of one Triton entry")
    t.add_argument("--repository", type=Path, default=Path("model_repository"))
    t.add_argument("--model", required=True, help="the entry to tune")
    t.add_argument("--instances", default="1,2,3", help="instance counts to consider (default %(default)s)")
    t.add_argument("--max-batch-size", default="1,8,32", help="max_batch_size values (default %(default)s)")
    t.add_argument("--queue-delay-us", default="0,500,2000", help="max_queue_delay_microseconds values (default %(default)s)")
    t.add_argument("--rate", type=float, default=0.0, help="--measure goodput: Poisson arrivals instead of --users (req/s)")
    v = sub.add_parser("vllm", parents=[scenario_parser()], help="--max-num-seqs x --max-num-batched-tokens of a vLLM engine")
    v.add_argument("model_dir", type=Path, metavar="MODEL", help="the model folder, as for `serve vllm`")
    v.add_argument("--served-model-name", default="", help="default: the folder's name")
    v.add_argument("--max-model-len", type=int, default=None)
    v.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="an adapter, as for `serve vllm`")
    v.add_argument("--max-num-seqs", default="4,8,16,32", help="values to consider (default %(default)s)")
    v.add_argument("--max-num-batched-tokens", default="512,1024,2048", help="values to consider (default %(default)s)")
    for p in (t, v):
        p.add_argument("--slo", required=True, metavar="NAME:MS,...", help="the limits, e.g. e2el:100 or ttft:500")
        p.add_argument("--measure", choices=MEASURES, default="capacity",
                       help="capacity: the most requests/s each configuration holds within the SLO (a capacity search); "
                            "goodput: its goodput at one fixed load (--users, or --rate)")
        p.add_argument("--users", type=int, default=16, help="--measure goodput: closed-loop users")
        p.add_argument("--start", type=float, default=1.0, help="--measure capacity: the first step's requests/s")
        p.add_argument("--precision", type=float, default=0.2,
                       help="--measure capacity: bisect until the interval is narrower than this share of the rate")
        p.add_argument("--max-steps", type=int, default=12, help="--measure capacity: steps per configuration at most")
        p.add_argument("--duration", type=float, default=15.0,
                       help="seconds of load per configuration (goodput) or per step of its search (capacity)")
        p.add_argument("--warmup", type=float, default=3.0)
        p.add_argument("--budget", type=int, default=8, help="configurations measured at most, the default included")
        p.add_argument("--out", type=Path, help="report folder (default reports/tune-<model>-<time>)")
    t.add_argument("--apply", action="store_true", help="write the recommendation into the repository")
    return parser


def _target_and_load(args) -> tuple[object, dict, dict]:
    from loadtest.runner import scenario_options
    from serve.entry_config import Batching

    if args.target == "triton":
        axes = {"instances": _values(args.instances, "instances"),
                "max_batch_size": _values(args.max_batch_size, "max-batch-size"),
                "max_queue_delay_us": _values(args.queue_delay_us, "queue-delay-us")}
        Batching(*(min(v) for v in axes.values()))  # refuses an impossible corner before any server starts
        target = TritonTarget(args.repository, args.model)
        options = scenario_options(scenario=target.scenario, model=args.model,
                                   **({"arrival": "poisson", "rate": args.rate} if args.rate else {}))
        return target, options, axes
    from serve.vllm_server import VLLMOptions

    axes = {"max_num_seqs": _values(args.max_num_seqs, "max-num-seqs"),
            "max_num_batched_tokens": _values(args.max_num_batched_tokens, "max-num-batched-tokens")}
    if min(axes["max_num_seqs"]) < 1 or min(axes["max_num_batched_tokens"]) < 1:
        raise ValueError("--max-num-seqs and --max-num-batched-tokens must be >= 1")
    adapters = dict(item.split("=", 1) for item in args.lora if "=" in item)
    if len(adapters) != len(args.lora):
        raise ValueError("--lora takes NAME=PATH")
    name = args.served_model_name or args.model_dir.name
    opts = VLLMOptions(model=args.model_dir, served_name=name, max_model_len=args.max_model_len,
                       adapters={k: Path(v) for k, v in adapters.items()})
    options = {k: v for k, v in vars(args).items() if k in scenario_options()}
    if options["trace"]:  # the recorded traffic, at each step's rate (capacity) or as recorded (goodput)
        options["scenario"], options["arrival"] = "replay", "trace"
    elif options["scenario"] not in ("chat", "completions"):
        options["scenario"] = "chat"
    options["model"] = options["model"] or name
    return VLLMTarget(opts), scenario_options(**options), axes


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    name = getattr(args, "model", "") if args.target == "triton" else args.model_dir.name
    out = args.out or Path("reports") / f"tune-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        target, options, axes = _target_and_load(args)
        search = Search(args.slo, axes, measure=args.measure, users=args.users, duration_s=args.duration,
                        warmup_s=args.warmup, budget=args.budget, apply=getattr(args, "apply", False),
                        start=args.start, precision=args.precision, max_steps=args.max_steps)
        result = tune(target, options=options, search=search, out=out, log=log)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"rtxserve tune: error: {exc}", file=sys.stderr)
        return 2
    print(f"{result.report.read_text().splitlines()[2].strip('*')}\nreport: {result.report}")
    return 0 if result.best else 1

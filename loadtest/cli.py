"""`rtxserve loadtest run|sweep|replay|report|compare`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from core.contract import GATEWAY_PORT


def _load_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the load goes, how long and from how many processes (the scenario's own options come from
    scenarios/options.py, the same ones locust is given)."""
    parser.add_argument("--host", default=os.environ.get("RTXSERVE_GATEWAY_URL", f"http://127.0.0.1:{GATEWAY_PORT}"),
                        help="gateway URL (env RTXSERVE_GATEWAY_URL; default %(default)s)")
    parser.add_argument("--users", type=int, default=8, help="closed loop: concurrent users")
    parser.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load, warm-up included")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds excluded from the figures")
    parser.add_argument("--workers", type=int, default=0,
                        help="locust worker processes under one master (0: a single process)")
    parser.add_argument("--slo", default="", metavar="NAME:MS,...",
                        help="limits for goodput: e2el, ttft, tpot, itl in ms, e.g. ttft:500,e2el:2000")
    parser.add_argument("--scrape", action="append", default=[], metavar="URL",
                        help="a server's Prometheus /metrics to plot beside the latency (Triton's :8002/metrics, "
                             "vLLM's /metrics); the gateway's is scraped too unless --no-scrape; repeatable")
    parser.add_argument("--no-scrape", action="store_true",
                        help="scrape nothing (not even the host's /metrics): only the load touches the servers")


def build_parser() -> argparse.ArgumentParser:
    from .runner import scenario_parser

    parser = argparse.ArgumentParser(prog="rtxserve loadtest", description="Load-test the gateway with locust.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", parents=[scenario_parser()], help="run a scenario headless and write a report")
    _load_arguments(r)
    r.add_argument("--out", type=Path, default=None, help="report folder (default reports/<scenario>-<time>)")
    s = sub.add_parser("sweep", parents=[scenario_parser()],
                       help="raise the rate (or users) step by step; report max QPS within the SLO, knee, best goodput")
    _load_arguments(s)
    s.add_argument("--steps", default="", metavar="V1,V2,...",
                   help="the rates (open loop) or user counts (closed) to try, in order (default: doubling from "
                        "--start until over-saturated)")
    s.add_argument("--start", type=float, default=1.0, help="first rate / users when --steps is not given")
    s.add_argument("--max-steps", type=int, default=8, help="steps at most")
    s.add_argument("--out", type=Path, default=None, help="report folder (default reports/sweep-<scenario>-<time>)")
    y = sub.add_parser("replay", parents=[scenario_parser()],
                       help="send a recorded trace's requests at its arrival times (open loop) and compare the two")
    _load_arguments(y)
    y.add_argument("trace_file", type=Path, metavar="TRACE", help="the gateway's trace (its trace_dir, one "
                   "trace-*.jsonl of it, or a folder of several gateways' trace_dirs, replayed as one), a Mooncake trace "
                   "or vLLM's timed trace (JSONL)")
    y.add_argument("--out", type=Path, default=None, help="report folder (default reports/replay-<time>)")
    y.add_argument("--analyze", action="store_true", help="say what the (fitted) trace holds and what fits the models "
                   "at --host, and send nothing")
    y.set_defaults(warmup=0.0, scenario="replay", arrival="trace")
    p = sub.add_parser("report", help="recompute the report from a run folder's raw samples")
    p.add_argument("folder", type=Path)
    p.add_argument("--warmup", type=float, default=None, help="default: the run's own")
    p.add_argument("--slo", default="", help="goodput limits, as for run")
    c = sub.add_parser("compare", help="before/after: every figure of two runs (or sweeps) side by side, curves "
                       "overlaid; of one run: the two models that answered it (an alias's targets)")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path, nargs="?", default=None)
    c.add_argument("--models", default=None, help="one run: the two models to compare, A,B (default: the two that "
                   "answered, when two did)")
    c.add_argument("--out", type=Path, default=None, help="folder for compare.md/.html (default: AFTER/compare, or "
                   "RUN/compare-models)")
    return parser


def _spec(args):
    from .runner import LoadSpec, scenario_options

    options = scenario_options(**{k: v for k, v in vars(args).items() if k in scenario_options()})
    return LoadSpec(host=args.host, options=options, users=args.users, spawn_rate=args.spawn_rate,
                    duration_s=args.duration, warmup_s=args.warmup, workers=args.workers, slo=args.slo,
                    scrape=[] if args.no_scrape else args.scrape, scrape_host=not args.no_scrape)


def _analyze(spec) -> str:
    """`replay --analyze`: the trace as fitted, and what fits the models at --host where it answers."""
    import httpx

    from .runner import auth_headers, contexts
    from .scenarios.fitting import analyze

    try:
        answer = httpx.get(f"{spec.host.rstrip('/')}/v1/models", headers=auth_headers(spec.options), timeout=5)
        found = contexts(answer.json().get("data", [])) if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        found = None
    return analyze(spec.trace, found)


def _fail(message) -> int:
    print(f"rtxserve loadtest: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        if args.command == "report":
            return _report(args)
        if args.command == "compare":
            from .report.compare import compare, compare_models

            if args.after is not None:
                if args.models:
                    return _fail("--models compares two models within one run: give one folder")
                path = compare(args.before, args.after, args.out or args.after / "compare")
            else:
                models = tuple(m.strip() for m in args.models.split(",")) if args.models else None
                if models is not None and len(models) != 2:
                    return _fail(f"--models takes two models, A,B; got {args.models!r}")
                path = compare_models(args.before, args.out or args.before / "compare-models", models)
            print(f"comparison: {path}")
            return 0
        if args.command == "replay":
            args.trace, args.scenario, args.arrival = str(args.trace_file), "replay", "trace"
        spec = _spec(args)
        if args.command == "replay" and args.analyze:
            print(_analyze(spec))
            return 0
        if args.command == "sweep":
            from .sweep import sweep

            out = args.out or Path("reports") / f"sweep-{spec.options['scenario']}-{stamp}"
            result = sweep(spec, out, steps=args.steps, start=args.start, max_steps=args.max_steps, log=log)
            print(f"{result.headline}\nreport: {result.report}")
            return 0
        from .runner import run

        result = run(spec, args.out or Path("reports") / f"{spec.options['scenario']}-{stamp}", log=log)
        if spec.replaying:
            print(f"recorded vs replayed: {_replayed(result.summary.replay)}")
    except (ValueError, RuntimeError, OSError) as exc:
        return _fail(exc)
    print(f"report: {result.report} (and {result.report.with_suffix('.html').name})")
    return 0 if result.summary.errors == 0 else 1


def capacity_parser() -> argparse.ArgumentParser:
    from .runner import scenario_parser

    parser = argparse.ArgumentParser(prog="rtxserve capacity", parents=[scenario_parser()],
                                     description="The most requests/s the box at --host holds within --slo, for a "
                                     "scenario's open-loop arrivals or a trace's (--trace): a ramp, a bisection and "
                                     "confirm runs at 0.9x and 1.1x; with --target-rps, the boxes that load needs.")
    _load_arguments(parser)
    parser.add_argument("--start", type=float, default=1.0, help="the first step's requests/s")
    parser.add_argument("--precision", type=float, default=0.1,
                        help="bisect until the interval is narrower than this share of the rate")
    parser.add_argument("--max-steps", type=int, default=12, help="steps at most (confirm runs not counted)")
    parser.add_argument("--max-errors", type=float, default=0.01, help="the share of failed requests a step may have")
    parser.add_argument("--no-confirm", action="store_true", help="skip the confirm runs at 0.9x and 1.1x")
    parser.add_argument("--target-rps", type=float, default=None, help="the load to plan for: how many boxes it needs")
    parser.add_argument("--headroom", type=float, default=0.2, help="the share of each box's capacity kept free")
    parser.add_argument("--record", action="store_true", help="send the confirmed answer to the gateway at --host "
                        "(an admin --api-key): it then says how much of it today's traffic uses "
                        "(its /metrics, `serve status`)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default reports/capacity-<time>)")
    parser.set_defaults(arrival="poisson", duration=20.0, warmup=2.0)
    return parser


def capacity_main(argv: list[str]) -> int:
    args = capacity_parser().parse_args(argv)
    if args.trace:
        args.scenario, args.arrival = "replay", "trace"
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        from .capacity import search

        spec = _spec(args)
        if args.record and (args.no_confirm or len(spec.models()) != 1):
            raise ValueError("--record keeps a confirmed capacity of one model's traffic: leave out --no-confirm, and "
                             f"send one model's requests (this traffic names {', '.join(spec.models())})")
        result = search(spec, args.out or Path("reports") / f"capacity-{time.strftime('%Y%m%d-%H%M%S')}",
                        start=args.start, precision=args.precision, max_steps=args.max_steps, max_errors=args.max_errors,
                        confirm=not args.no_confirm, target_rps=args.target_rps, headroom=args.headroom, log=log)
        recorded = record_capacity(spec, result) if args.record else ""
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"rtxserve capacity: error: {exc}", file=sys.stderr)
        return 2
    print(f"{result.headline}\nreport: {result.report}{recorded}")
    return 0 if result.answer is not None else 1


def record_capacity(spec, result) -> str:
    """--record: the confirmed answer sent to the gateway (PUT /admin/capacity/MODEL); what to print of it."""
    import httpx

    from .runner import auth_headers

    models = spec.models()
    held = [s for s in result.steps if s["phase"] == "confirm-0.9x" and s["holds"]]
    if result.answer is None or not held:
        raise ValueError("--record: no confirmed capacity to record (the answer needs its 0.9x confirm run to hold; "
                         "leave out --no-confirm)")
    answer = httpx.put(f"{spec.host.rstrip('/')}/admin/capacity/{models[0]}", headers=auth_headers(spec.options),
                       json={"requests_per_second": round(result.answer, 3), "slo": spec.slo,
                             "how": result.headline[:1000]}, timeout=30)
    if answer.status_code != 200:
        raise ValueError(f"--record: the gateway refused it (HTTP {answer.status_code}: {answer.text[:300]})")
    return f"\nrecorded: {models[0]} holds {result.answer:.3g} requests/s at {spec.slo} (stale: no)"


def _replayed(figures: dict) -> str:
    rec, rep, corr = figures["recorded"], figures["replayed"], figures["arrivals"]["correlation"]
    return (f"{rec['requests']} requests in {rec['span_s']:.1f} s recorded, {rep['requests']} sent in "
            f"{rep['span_s']:.1f} s ({rep['errors']} failed); arrivals correlated "
            f"{'–' if corr is None else f'{corr:.2f}'}")


def _report(args) -> int:
    from .report.pages import write_report
    from core.slo import parse_slo

    from .report.report import headline, load_samples, summarize

    path = args.folder / "samples.csv"
    if not path.exists():
        return _fail(f"no samples.csv in {args.folder}")
    samples = load_samples(path)
    if not len(samples.end):
        return _fail(f"no samples in {path}")
    import json

    saved = args.folder / "report.json"
    before = json.loads(saved.read_text()) if saved.exists() else {}
    warmup = args.warmup if args.warmup is not None else before.get("warmup_s", 5.0)
    settings = {**before.get("settings", {}), "recomputed from": str(path)}  # the run's settings stay
    summary = summarize(samples, warmup, settings, parse_slo(args.slo))
    summary.replay = before.get("replay", {})  # a replay's comparison with its trace stays
    report = write_report(summary, samples, args.folder, f"rtxserve load test ({args.folder.name})")
    print(f"{headline(summary)}\nreport: {report}")
    return 0

"""`rtxserve tune triton`: search a Triton entry's instances x max_batch_size x queue delay for the most
goodput under an SLO, each configuration served by a freshly started tritonserver + gateway and loaded
by the same locust run; recommend the best and, with --apply, write it into the repository.

The search is Triton Model Analyzer's quick search: measure the entry as it is (the default, so that the
recommendation is compared with it in the same run), then climb from the smallest configuration, each
time measuring the untried neighbours (one step along one axis) of the best so far, until none is better
or the budget of configurations is spent. A configuration counts only if its P99 meets the SLO and at most
1 % of its requests failed; among those, goodput (requests per second within every limit) decides.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path

from rtxserve import contract

# The load scenario that exercises each task's route.
SCENARIO_OF_TASK = {contract.TEXT_CLASSIFICATION: "classify", contract.IMAGE_CLASSIFICATION: "image",
                    contract.TOKEN_CLASSIFICATION: "ner", contract.FEATURE_EXTRACTION: "embeddings"}
AXES = ("instances", "max_batch_size", "max_queue_delay_us")
MAX_ERROR_FRACTION = 0.01


@dataclass
class Trial:
    config: dict  # the three knobs
    default: bool = False
    goodput_rps: float = 0.0
    qps: float = 0.0
    p99_ms: float | None = None
    errors: int = 0
    requests: int = 0
    eligible: bool = False  # P99 within the SLO and few errors
    report: str = ""
    failure: str = ""  # the server did not start, or the load failed

    def label(self) -> str:
        c = self.config
        return f"{c['instances']} inst, batch {c['max_batch_size']}, delay {c['max_queue_delay_us']} us"


@dataclass
class TuneResult:
    trials: list[Trial]
    best: Trial | None
    default: Trial
    report: Path
    applied: bool = False
    notes: list[str] = field(default_factory=list)


def _values(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 0:
        raise ValueError(f"--{what}: expected comma-separated whole numbers, not {text!r}")
    return values


def quick_search(axes: dict[str, list[int]], measure, budget: int, log=print) -> list[Trial]:
    """Climb from the smallest configuration to its best neighbour while that is better (see the module doc)."""
    tried: dict[tuple, Trial] = {}

    def score(t: Trial) -> tuple:
        return (t.eligible, t.goodput_rps if t.eligible else -(t.p99_ms or float("inf")))

    def run(index: tuple) -> Trial:
        if index not in tried:
            tried[index] = measure({a: axes[a][i] for a, i in zip(AXES, index)})
        return tried[index]

    best_index = (0, 0, 0)
    best = run(best_index)
    while len(tried) < budget:
        neighbours = [tuple(i + d if k == axis else i for k, i in enumerate(best_index))
                      for axis in range(len(AXES)) for d in (1, -1)]
        neighbours = [n for n in neighbours if all(0 <= i < len(axes[a]) for a, i in zip(AXES, n)) and n not in tried]
        if not neighbours:
            break
        for n in neighbours[: budget - len(tried)]:
            run(n)
        leader = max(neighbours, key=lambda n: score(tried[n]) if n in tried else (False, float("-inf")))
        if leader not in tried or score(tried[leader]) <= score(best):
            break
        best_index, best = leader, tried[leader]
        log(f"climbing to {best.label()}")
    return list(tried.values())


def evaluate(repository: Path, name: str, config: dict, spec_for, work: Path, log) -> Trial:
    from loadtest.runner import run
    from serve.entry_config import Batching, copy_entry, write_batching
    from serve.launcher import ServerStartError
    from serve.stack import start_stack

    trial = Trial(config)
    folder = work / f"{config['instances']}inst-b{config['max_batch_size']}-d{config['max_queue_delay_us']}"
    repo = copy_entry(repository, name, folder / "repository")
    write_batching(repo, name, Batching(**config))
    log(f"config {trial.label()}: starting tritonserver and the gateway")
    try:
        with start_stack(repo, folder / "logs") as stack:
            result = run(spec_for(stack), folder / "load", log=lambda m: log(f"  {m}"))
    except (ServerStartError, RuntimeError) as exc:
        trial.failure = str(exc)[-1500:]
        log(f"config {trial.label()} failed: {trial.failure.splitlines()[0]}")
        return trial
    s = result.summary
    trial.goodput_rps, trial.qps, trial.p99_ms = s.goodput.get("goodput_rps", 0.0), s.qps, s.latency_ms.get("p99")
    trial.errors, trial.requests, trial.report = s.errors, s.requests, str(result.report.relative_to(work))
    trial.eligible = s.goodput.get("p99_within_slo", False) and s.errors <= MAX_ERROR_FRACTION * max(1, s.requests)
    log(f"config {trial.label()}: goodput {trial.goodput_rps:.1f} req/s, QPS {trial.qps:.1f}, P99 "
        f"{trial.p99_ms or float('nan'):.1f} ms{'' if trial.eligible else ' (does not meet the SLO)'}")
    return trial


def tune_triton(repository: Path, name: str, *, slo: str, axes: dict[str, list[int]], users: int = 16,
                rate: float = 0.0, duration_s: float = 15.0, warmup_s: float = 3.0, budget: int = 8,
                apply: bool = False, out: Path, log=print) -> TuneResult:
    from loadtest.report import parse_slo
    from loadtest.runner import LoadSpec, scenario_options
    from serve.entry_config import Batching, entry_models, read_batching, write_batching

    if not parse_slo(slo):
        raise ValueError("--slo is required: goodput is counted against it (e.g. e2el:100)")
    if budget < 2:
        raise ValueError("--budget must be at least 2 (the default and one other configuration)")
    entry = entry_models(repository, name)[0]
    task = _task(entry)
    options = scenario_options(scenario=SCENARIO_OF_TASK[task], model=name,
                               **({"arrival": "poisson", "rate": rate} if rate else {}))

    def spec_for(stack) -> LoadSpec:
        return LoadSpec(stack.gateway_url, dict(options), users=users, duration_s=duration_s, warmup_s=warmup_s,
                        slo=slo, scrape=[stack.triton_metrics_url])

    spec_for(argparse.Namespace(gateway_url="http://127.0.0.1:1", triton_metrics_url="")).check()
    out.mkdir(parents=True, exist_ok=True)
    current = asdict(read_batching(repository, name))
    log(f"tuning {name} ({task}) in {repository}: default {Trial(current).label()}; SLO {slo}")
    default = evaluate(repository, name, current, spec_for, out, log)
    default.default = True
    measured = {tuple(current.values()): default}  # the climb may pass through the default: measure it once

    def measure(config: dict) -> Trial:
        key = tuple(config[a] for a in AXES)
        if key not in measured:
            measured[key] = evaluate(repository, name, config, spec_for, out, log)
        return measured[key]

    quick_search(axes, measure, budget, log)
    trials = list(measured.values())
    eligible = [t for t in trials if t.eligible]
    best = max(eligible, key=lambda t: t.goodput_rps) if eligible else None
    result = TuneResult(trials, best, default, out / "tune.md")
    if best is None:
        result.notes.append("No configuration met the SLO: loosen it, lower the load, or widen the axes.")
    elif apply and best.config != current:
        write_batching(repository, name, Batching(**best.config))
        result.applied = True
        result.notes.append(f"Applied: {best.label()} written into {repository}/{name} and its steps.")
    _write_report(result, name, slo, out, users, rate)
    return result


def _task(entry: Path) -> str:
    from serve.entry_config import read_config

    config = read_config(entry / "config.pbtxt")
    task = config.parameters[contract.PARAM_TASK].string_value if contract.PARAM_TASK in config.parameters else ""
    if task not in SCENARIO_OF_TASK:
        raise ValueError(f"{entry.name} is not a servable encoder entry (task {task or 'none'}); "
                         f"tune takes {', '.join(SCENARIO_OF_TASK)}")
    return task


def _plot(result: TuneResult, path: Path) -> Path:
    from loadtest.plots import pyplot, save

    plt = pyplot()
    trials = result.trials
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(trials) + 3), 4.8))
    colours = ["tab:gray" if t.default else "tab:green" if t is result.best else "tab:blue" if t.eligible else "tab:red"
               for t in trials]
    ax.bar(range(len(trials)), [t.goodput_rps for t in trials], color=colours)
    ax.set_xticks(range(len(trials)), [t.label().replace(", ", "\n") for t in trials], fontsize=7)
    for i, t in enumerate(trials):
        ax.text(i, t.goodput_rps, f"P99 {t.p99_ms or float('nan'):.0f} ms", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_xlabel("in the order measured. grey: the default, green: recommended, red: misses the SLO", fontsize=9)
    return save(fig, path, "rtxserve tune: goodput per configuration")


def _write_report(result: TuneResult, name: str, slo: str, out: Path, users: int, rate: float) -> None:
    from loadtest.pages import versions, write_html

    _plot(result, out / "tune.png")
    rows = "\n".join(f"| {t.label()}{' (default)' if t.default else ''} | {t.goodput_rps:.1f} | {t.qps:.1f} | "
                     f"{'–' if t.p99_ms is None else f'{t.p99_ms:.1f}'} | {t.errors}/{t.requests} | "
                     f"{'yes' if t.eligible else 'no'} | {f'[report]({t.report})' if t.report else t.failure[:80]} |"
                     for t in result.trials)
    best, default = result.best, result.default
    if best is None:
        verdict = "no configuration met the SLO"
    else:
        gain = (best.goodput_rps / default.goodput_rps - 1) if default.goodput_rps else float("inf")
        verdict = (f"recommended: {best.label()}: goodput {best.goodput_rps:.1f} req/s vs {default.goodput_rps:.1f} for "
                   f"the default ({gain:+.0%})")
    load = f"Poisson arrivals at {rate:g} req/s" if rate else f"{users} closed-loop users"
    command = (f"rtxserve export onnx CHECKPOINT --name {name} --instances {best.config['instances']} --max-batch-size "
               f"{best.config['max_batch_size']} --max-queue-delay-us {best.config['max_queue_delay_us']}") if best else ""
    md = f"""# rtxserve tune: {name}

**{verdict}**

{"".join(f"> {n}" + chr(10) + chr(10) for n in result.notes)}![goodput per configuration](tune.png)

Each configuration: its own tritonserver and gateway, then {load}; SLO {slo}. Goodput counts the requests
within every limit; a configuration qualifies when its P99 meets the SLO and at most {MAX_ERROR_FRACTION:.0%} of
its requests failed. Search: Model Analyzer's quick search (climb from the smallest configuration to the best
neighbour while it improves).

| configuration | goodput req/s | QPS | P99 ms | errors | qualifies | load |
|---|---|---|---|---|---|---|
{rows}

{f"To export with it again: `{command}`; `rtxserve tune ... --apply` writes it into the repository." if best else ""}
"""
    (out / "tune.md").write_text(md)
    write_html(md, out, f"rtxserve tune: {name}", "tune.html")
    (out / "tune.json").write_text(json.dumps({"trials": [asdict(t) for t in result.trials], "applied": result.applied,
                                               "best": asdict(best) if best else None, "slo": slo,
                                               "versions": versions()}, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtxserve tune", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="target", required=True)
    t = sub.add_parser("triton", help="instances x max_batch_size x queue delay of one Triton entry")
    t.add_argument("--repository", type=Path, default=Path("model_repository"))
    t.add_argument("--model", required=True, help="the entry to tune")
    t.add_argument("--slo", required=True, metavar="NAME:MS,...", help="goodput limits, e.g. e2el:100")
    t.add_argument("--instances", default="1,2,3", help="instance counts to consider (default %(default)s)")
    t.add_argument("--max-batch-size", default="1,8,32", help="max_batch_size values (default %(default)s)")
    t.add_argument("--queue-delay-us", default="0,500,2000", help="max_queue_delay_microseconds values (default %(default)s)")
    t.add_argument("--users", type=int, default=16, help="closed-loop users of each measurement")
    t.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals instead of users (req/s)")
    t.add_argument("--duration", type=float, default=15.0, help="seconds of load per configuration")
    t.add_argument("--warmup", type=float, default=3.0)
    t.add_argument("--budget", type=int, default=8, help="configurations measured at most, the default included")
    t.add_argument("--apply", action="store_true", help="write the recommendation into the repository")
    t.add_argument("--out", type=Path, help="report folder (default reports/tune-<model>-<time>)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    out = args.out or Path("reports") / f"tune-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        axes = {"instances": _values(args.instances, "instances"),
                "max_batch_size": _values(args.max_batch_size, "max-batch-size"),
                "max_queue_delay_us": _values(args.queue_delay_us, "queue-delay-us")}
        from serve.entry_config import Batching

        Batching(*(min(v) for v in axes.values()))  # refuses an impossible corner before any server starts
        result = tune_triton(args.repository, args.model, slo=args.slo, axes=axes, users=args.users, rate=args.rate,
                             duration_s=args.duration, warmup_s=args.warmup, budget=args.budget, apply=args.apply,
                             out=out, log=log)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"rtxserve tune: error: {exc}", file=sys.stderr)
        return 2
    print(f"{result.report.read_text().splitlines()[2].strip('*')}\nreport: {result.report}")
    return 0 if result.best else 1

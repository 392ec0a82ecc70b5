"""`rtxserve tune triton|vllm`: search a server's knobs for the configuration that holds the most load within an
SLO, each configuration served by freshly started servers; recommend the best and, for Triton with --apply, write
it into the repository.

- triton: one entry's instances x max_batch_size x queue delay (serve/entry_config.py);
- vllm: the engine's --max-num-seqs x --max-num-batched-tokens.

The search is Triton Model Analyzer's quick search: measure the server as it is (the default, so that the
recommendation is compared with it in the same run), then climb from the smallest configuration, each
time measuring the untried neighbours (one step along one axis) of the best so far, until none is better
or the budget of configurations is spent.

What each configuration is measured by (`--measure`):
- capacity (the default): the capacity search of `rtxserve capacity` (loadtest/capacity.py: open-loop arrivals, a
  ramp and a bisection, no confirm runs) finds the most requests/s it holds with its P99 within the SLO, at most
  1 % failed and keeping up; the configuration that holds the most wins. A configuration whose first step misses is
  searched once more (a freshly started server's first seconds can stall); if it misses again it holds nothing and
  does not qualify.
- goodput: one run at a fixed load (`--users` closed-loop users, or `--rate`); a configuration qualifies if its P99
  meets the SLO and at most 1 % of its requests failed; among those, goodput (requests/s within every limit) wins.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core import contract
from core.tasks import TASKS

# The load scenario that exercises each task's route.
SCENARIO_OF_TASK = {name: task.loadtest[0] for name, task in TASKS.items() if task.kind == contract.ENCODER}
MEASURES = ("capacity", "goodput")
SHORT = {"instances": "inst", "max_batch_size": "batch", "max_queue_delay_us": "delay us",
         "max_num_seqs": "seqs", "max_num_batched_tokens": "batched tokens"}


@dataclass
class Trial:
    config: dict  # knob -> value
    default: bool = False
    goodput_rps: float = 0.0
    qps: float = 0.0
    p99_ms: float | None = None
    errors: int = 0
    requests: int = 0
    eligible: bool = False  # P99 within the SLO and few errors
    capacity_rps: float | None = None  # --measure capacity: the most requests/s it held (None: its first step missed)
    missed_at_rps: float | None = None  # the least it missed at (None: every step held, the search ran out of steps)
    steps: int = 0  # --measure capacity: the search's steps
    report: str = ""
    failure: str = ""  # the server did not start, or the load failed

    def figure(self, measure: str) -> float:
        """What configurations are compared by: requests/s held within the SLO, or goodput at the fixed load."""
        return (self.capacity_rps or 0.0) if measure == "capacity" else self.goodput_rps

    def label(self) -> str:
        return ", ".join(f"{SHORT.get(k, k)} {'(server default)' if v is None else v}" for k, v in self.config.items())


@dataclass(frozen=True)
class Search:
    """What `tune` searches and how it measures: the SLO, the values of each knob to consider (`axes`), what a
    configuration is measured by (module doc) and its load (closed-loop users or the scenario's rate for goodput; the
    capacity search's first rate, precision and steps; seconds and warm-up of each run), how many configurations at
    most (the default included), and whether to write the best into the target."""

    slo: str
    axes: dict[str, list[int]]
    measure: str = "capacity"
    users: int = 16
    duration_s: float = 15.0
    warmup_s: float = 3.0
    budget: int = 8
    apply: bool = False
    start: float = 1.0
    precision: float = 0.2
    max_steps: int = 12

    def __post_init__(self):
        from core.slo import parse_slo

        if not parse_slo(self.slo):
            raise ValueError("--slo is required: every configuration is judged by it (e.g. e2el:100)")
        if self.budget < 2:
            raise ValueError("--budget must be at least 2 (the default and one other configuration)")
        if self.measure not in MEASURES:
            raise ValueError(f"--measure: one of {', '.join(MEASURES)}, not {self.measure!r}")
        if self.measure == "capacity":
            from loadtest.capacity import check_bounds

            check_bounds(self.start, self.precision, self.max_steps)


@dataclass
class TuneResult:
    trials: list[Trial]
    best: Trial | None
    default: Trial
    report: Path
    applied: bool = False
    notes: list[str] = field(default_factory=list)


class TritonTarget:
    """One Triton entry; each configuration a copy of it (weights hard-linked) with its knobs set."""

    def __init__(self, repository: Path, name: str):
        from serve.entry_config import entry_models, read_config

        self.repository, self.name = repository, name
        config = read_config(entry_models(repository, name)[0] / "config.pbtxt")
        task = config.parameters[contract.PARAM_TASK].string_value if contract.PARAM_TASK in config.parameters else ""
        if task not in SCENARIO_OF_TASK:
            raise ValueError(f"{name} is not a servable encoder entry (task {task or 'none'}); "
                             f"tune takes {', '.join(SCENARIO_OF_TASK)}")
        self.scenario, self.what = SCENARIO_OF_TASK[task], f"{name} ({task}) in {repository}"

    def current(self) -> dict:
        from serve.entry_config import read_batching

        return asdict(read_batching(self.repository, self.name))

    @contextlib.contextmanager
    def serve(self, config: dict, folder: Path):
        from serve.entry_config import Batching, copy_entry, write_batching
        from serve.stack import start_stack

        repo = copy_entry(self.repository, self.name, folder / "repository")
        write_batching(repo, self.name, Batching(**config))
        with start_stack(repo, folder / "logs") as stack:
            yield stack.gateway_url, [stack.triton_metrics_url]

    def apply(self, config: dict) -> str:
        from serve.entry_config import Batching, write_batching

        write_batching(self.repository, self.name, Batching(**config))
        return f"written into {self.repository}/{self.name} and its steps"

    def reproduce(self, config: dict) -> str:
        return (f"rtxserve export onnx CHECKPOINT --name {self.name} --instances {config['instances']} "
                f"--max-batch-size {config['max_batch_size']} --max-queue-delay-us {config['max_queue_delay_us']}")


class VLLMTarget:
    """One vLLM engine (model, adapters and options as `serve vllm` takes them), restarted per configuration."""

    def __init__(self, opts):
        self.opts, self.scenario, self.what = opts, None, f"vLLM serving {opts.served_name} from {opts.model}"

    def current(self) -> dict:
        # None: the flag is not given, and vLLM picks its own default (it depends on the platform and memory)
        return {"max_num_seqs": None, "max_num_batched_tokens": None}

    @contextlib.contextmanager
    def serve(self, config: dict, folder: Path):
        import dataclasses

        from serve.stack import start_gateway, start_vllm

        extra = list(self.opts.extra_args)
        for knob, value in config.items():
            if value is not None:
                extra += [f"--{knob.replace('_', '-')}", str(value)]
        opts = dataclasses.replace(self.opts, extra_args=extra)
        vllm, url = start_vllm(opts, folder, timeout_s=600)
        try:
            gateway, gateway_url = start_gateway("", folder, vllm_url=url)
            try:
                yield gateway_url, [f"{url}/metrics"]
            finally:
                gateway.stop()
        finally:
            vllm.stop()

    def apply(self, config: dict) -> str:
        raise ValueError("--apply writes Triton entries; for vLLM, start it with the recommended flags")

    def reproduce(self, config: dict) -> str:
        flags = " ".join(f"--vllm-arg=--{k.replace('_', '-')}={v}" for k, v in config.items() if v is not None)
        return f"rtxserve serve vllm {self.opts.model} {flags}".strip()


def quick_search(axes: dict[str, list[int]], measure, budget: int, log=print, by: str = "goodput") -> list[Trial]:
    """Climb from the smallest configuration to its best neighbour while that is better (see the module doc); `by`:
    what configurations are compared by (Trial.figure)."""
    names = list(axes)
    tried: dict[tuple, Trial] = {}

    def score(t: Trial) -> tuple:
        return (t.eligible, t.figure(by) if t.eligible else -(t.p99_ms or float("inf")))

    def run(index: tuple) -> Trial:
        if index not in tried:
            tried[index] = measure({a: axes[a][i] for a, i in zip(names, index)})
        return tried[index]

    best_index = (0,) * len(names)
    best = run(best_index)
    while len(tried) < budget:
        neighbours = [tuple(i + d if k == axis else i for k, i in enumerate(best_index))
                      for axis in range(len(names)) for d in (1, -1)]
        neighbours = [n for n in neighbours if all(0 <= i < len(axes[a]) for a, i in zip(names, n)) and n not in tried]
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


def evaluate(target, config: dict, spec_for, work: Path, log, search: Search | None = None) -> Trial:
    """Serve `config`, load it with `spec_for(gateway_url, scrape_urls)` (one run, or with `search.measure` capacity
    a capacity search), and return its figures."""
    from loadtest.runner import run
    from serve.launcher import ServerStartError

    trial = Trial(config)
    folder = work / "-".join(f"{SHORT.get(k, k).split()[0]}{'default' if v is None else v}" for k, v in config.items())
    log(f"config {trial.label()}: starting the servers")
    try:
        with target.serve(config, folder) as (gateway_url, scrape):
            if search is not None and search.measure == "capacity":
                from loadtest.capacity import search as capacity

                def find(name: str):
                    return capacity(spec_for(gateway_url, scrape), folder / name, start=search.start,
                                    precision=search.precision, max_steps=search.max_steps, confirm=False,
                                    log=lambda m: log(f"  {m}"))

                found = find("capacity")
                if found.answer is None:  # one step is cheap to repeat, and a fresh server's first seconds can stall
                    log(f"  its first step missed ({found.steps[0]['why_not']}); searching once more")
                    found = find("capacity-again")
            else:
                result = run(spec_for(gateway_url, scrape), folder / "load", log=lambda m: log(f"  {m}"))
    except (ServerStartError, RuntimeError, ValueError) as exc:
        trial.failure = str(exc)[-1500:]
        log(f"config {trial.label()} failed: {trial.failure.splitlines()[0]}")
        return trial
    if search is not None and search.measure == "capacity":
        return _held(trial, found, work, log)
    return _loaded(trial, result, work, log)


def _held(trial: Trial, found, work: Path, log) -> Trial:
    """A capacity search's answer as the trial's figures: those of the step at the rate it held."""
    trial.steps, trial.report, trial.capacity_rps = len(found.steps), str(found.report.relative_to(work)), found.answer
    trial.missed_at_rps = min((s["load"] for s in found.steps if not s["holds"]), default=None)
    held = [s for s in found.steps if s["holds"] and s["load"] == found.answer]
    step = held[0] if held else found.steps[0]  # the first step, when it already missed: its figures say why
    trial.goodput_rps, trial.qps, trial.p99_ms = step["goodput_rps"], step["qps"], step["p99_ms"]
    trial.errors, trial.requests, trial.eligible = step["errors"], step["requests"], found.answer is not None
    log(f"config {trial.label()}: " + (f"holds {found.answer:.3g} req/s (P99 {trial.p99_ms or math.nan:.1f} ms)"
                                       if trial.eligible else f"does not meet the SLO: {found.headline}"))
    return trial


def _loaded(trial: Trial, result, work: Path, log) -> Trial:
    """One run's figures as the trial's."""
    from loadtest.report import MAX_ERROR_FRACTION

    s = result.summary
    trial.goodput_rps, trial.qps, trial.p99_ms = s.goodput.get("goodput_rps", 0.0), s.qps, s.latency_ms.get("p99")
    trial.errors, trial.requests, trial.report = s.errors, s.requests, str(result.report.relative_to(work))
    trial.eligible = s.goodput.get("p99_within_slo", False) and s.errors <= MAX_ERROR_FRACTION * max(1, s.requests)
    log(f"config {trial.label()}: goodput {trial.goodput_rps:.1f} req/s, QPS {trial.qps:.1f}, P99 "
        f"{trial.p99_ms or math.nan:.1f} ms{'' if trial.eligible else ' (does not meet the SLO)'}")
    return trial


def tune(target, *, options: dict, search: Search, out: Path, log=print) -> TuneResult:
    """Measure the default, quick-search `search.axes`, write tune.md/.html/.png/.json into `out` (see the module
    doc). `options` are the load's scenario options (loadtest.runner.scenario_options); measured by capacity, a
    closed loop's become Poisson arrivals (the search sets their rate)."""
    from loadtest.runner import LoadSpec

    axes, slo, by = search.axes, search.slo, search.measure
    if by == "capacity" and options["arrival"] == "closed":
        options = options | {"arrival": "poisson"}

    def spec_for(url: str, scrape: list[str]) -> LoadSpec:
        return LoadSpec(url, dict(options), users=search.users, duration_s=search.duration_s, warmup_s=search.warmup_s,
                        slo=slo, scrape=scrape)

    first = spec_for("http://127.0.0.1:1", [])  # a load that cannot run is refused before any server starts
    if by == "capacity" and not first.replaying:
        first.options["rate"] = search.start
    first.check()
    out.mkdir(parents=True, exist_ok=True)
    current = target.current()
    log(f"tuning {target.what}: default {Trial(current).label()}; SLO {slo}; measured by {by}")
    default = evaluate(target, current, spec_for, out, log, search)
    default.default = True
    measured = {tuple(current.values()): default}  # the climb may pass through the default: measure it once

    def measure(config: dict) -> Trial:
        key = tuple(config.values())
        if key not in measured:
            measured[key] = evaluate(target, config, spec_for, out, log, search)
        return measured[key]

    # The default counts against the budget unless the climb can reach it (then it is measured once anyway).
    on_grid = all(current[k] in axes[k] for k in axes)
    quick_search(axes, measure, search.budget if on_grid else search.budget - 1, log, by=by)
    trials = list(measured.values())
    eligible = [t for t in trials if t.eligible]
    best = max(eligible, key=lambda t: t.figure(by)) if eligible else None
    result = TuneResult(trials, best, default, out / "tune.md")
    if best is None:
        result.notes.append("No configuration met the SLO: loosen it, lower the load, or widen the axes.")
    elif search.apply and best.config != current:
        result.notes.append(f"Applied: {best.label()} {target.apply(best.config)}.")
        result.applied = True
    _write_report(result, target, search, out, _load(options, search))
    return result


def _load(options: dict, search: Search) -> str:
    """Each configuration's load, in words."""
    trace = f"the trace {Path(options['trace']).name}" if options["scenario"] == "replay" else ""
    if search.measure == "capacity":
        what = trace or f"{options['scenario']} requests, {options['arrival']} arrivals"
        return (f"a capacity search of {what} (from {search.start:g} req/s, doubling while it holds, then bisecting "
                f"to {search.precision:.0%}; {search.duration_s:g} s a step)")
    if options["arrival"] != "closed":
        rate = trace or f"{options['rate']:g} req/s"
        return f"{rate} ({options['arrival']}) for {search.duration_s:g} s"
    return f"{search.users} closed-loop users for {search.duration_s:g} s"


def _plot(result: TuneResult, by: str, path: Path) -> Path:
    from loadtest.plots import pyplot, save

    plt = pyplot()
    trials = result.trials
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(trials) + 3), 4.8))
    colours = ["tab:gray" if t.default else "tab:green" if t is result.best else "tab:blue" if t.eligible else "tab:red"
               for t in trials]
    ax.bar(range(len(trials)), [t.figure(by) for t in trials], color=colours)
    ax.set_xticks(range(len(trials)), [t.label().replace(", ", "\n") for t in trials], fontsize=7)
    for i, t in enumerate(trials):
        ax.text(i, t.figure(by), f"P99 {t.p99_ms or math.nan:.0f} ms", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("requests/s held within the SLO" if by == "capacity" else "goodput (requests/s within the SLO)")
    ax.set_xlabel("in the order measured. grey: the default, green: recommended, red: misses the SLO", fontsize=9)
    title = "capacity" if by == "capacity" else "goodput"
    return save(fig, path, f"rtxserve tune: {title} per configuration")


def _cell(text: str) -> str:
    """A failure's first line, fit for a Markdown table cell (the whole log tail is in tune.json)."""
    return text.splitlines()[0].replace("|", "/")[:100] if text else ""


def _row(t: Trial, by: str) -> str:
    """A configuration's row of the report's table (its columns: what `by` measures)."""
    fmt = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    if by == "capacity":
        measured = [fmt(t.capacity_rps) if t.eligible else "none",
                    "never" if t.missed_at_rps is None else fmt(t.missed_at_rps), str(t.steps)]
    else:
        measured = [f"{t.goodput_rps:.1f}", f"{t.qps:.1f}"]
    cells = [t.label() + (" (default)" if t.default else ""), *measured, fmt(t.p99_ms), f"{t.errors}/{t.requests}",
             "yes" if t.eligible else "no", f"[report]({t.report})" if t.report else _cell(t.failure)]
    return f"| {' | '.join(cells)} |"


def _write_report(result: TuneResult, target, search: Search, out: Path, load: str) -> None:
    from loadtest.pages import versions, write_html
    from loadtest.report import MAX_ERROR_FRACTION

    by = search.measure
    _plot(result, by, out / "tune.png")
    rows = "\n".join(_row(t, by) for t in result.trials)
    best, default = result.best, result.default
    unit = "req/s held within the SLO" if by == "capacity" else "req/s goodput"
    if best is None:
        verdict = "no configuration met the SLO"
    else:
        theirs = default.figure(by)
        gain = f"{best.figure(by) / theirs - 1:+.0%}" if theirs else "the default held none"
        verdict = (f"recommended: {best.label()}: {best.figure(by):.1f} {unit} vs {theirs:.1f} for the default "
                   f"({gain})")
    if by == "capacity":
        header = ("| configuration | holds req/s | missed at req/s | steps | P99 ms at it | errors at it | qualifies | search |"
                  "\n|---|---|---|---|---|---|---|---|")
        rule = (f"A configuration holds a rate when its P99 meets the SLO, at most {MAX_ERROR_FRACTION:.0%} of its "
                "requests failed and it kept up (`rtxserve capacity`'s steps, without its confirm runs: confirm the "
                "recommendation with `rtxserve capacity`); the one that holds the most wins.")
    else:
        header = "| configuration | goodput req/s | QPS | P99 ms | errors | qualifies | load |\n|---|---|---|---|---|---|---|"
        rule = (f"Goodput counts the requests within every limit; a configuration qualifies when its P99 meets the SLO "
                f"and at most {MAX_ERROR_FRACTION:.0%} of its requests failed.")
    md = f"""# rtxserve tune: {target.what}

**{verdict}**

{"".join(f"> {n}" + chr(10) + chr(10) for n in result.notes)}![{by} per configuration](tune.png)

Each configuration: its own servers, then {load}; SLO {search.slo}. {rule}
Search: Model Analyzer's quick search (climb from the smallest configuration to the best neighbour while it
improves).

{header}
{rows}

{f"To serve with it: `{target.reproduce(best.config)}`." if best else ""}
"""
    (out / "tune.md").write_text(md)
    write_html(md, out, f"rtxserve tune: {target.what}", "tune.html")
    (out / "tune.json").write_text(json.dumps({"trials": [asdict(t) for t in result.trials], "applied": result.applied,
                                               "best": asdict(best) if best else None, "slo": search.slo,
                                               "measure": by, "versions": versions()}, indent=2))


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

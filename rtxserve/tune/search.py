"""What `rtxserve tune` searches and how: the configurations (Trial), the search's settings (Search), the climb
(quick_search, Model Analyzer's), and each configuration served and measured (evaluate); run.py's `tune` runs them
all."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

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
    from loadtest.report.report import MAX_ERROR_FRACTION

    s = result.summary
    trial.goodput_rps, trial.qps, trial.p99_ms = s.goodput.get("goodput_rps", 0.0), s.qps, s.latency_ms.get("p99")
    trial.errors, trial.requests, trial.report = s.errors, s.requests, str(result.report.relative_to(work))
    trial.eligible = s.goodput.get("p99_within_slo", False) and s.errors <= MAX_ERROR_FRACTION * max(1, s.requests)
    log(f"config {trial.label()}: goodput {trial.goodput_rps:.1f} req/s, QPS {trial.qps:.1f}, P99 "
        f"{trial.p99_ms or math.nan:.1f} ms{'' if trial.eligible else ' (does not meet the SLO)'}")
    return trial

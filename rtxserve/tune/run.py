"""`tune`: the default measured, the climb from the smallest configuration, the best recommended (and applied where
asked), and the report written."""

from __future__ import annotations

from pathlib import Path

from .report import describe_load, write_report
from .search import Search, Trial, TuneResult, evaluate, quick_search


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
    write_report(result, target, search, out, describe_load(options, search))
    return result

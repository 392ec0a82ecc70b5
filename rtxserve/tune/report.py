"""`rtxserve tune`'s report: tune.md / .html / .json and the plot of each configuration's figure."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .search import Search, Trial, TuneResult

def describe_load(options: dict, search: Search) -> str:
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
    from loadtest.report.plots import pyplot, save

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


def write_report(result: TuneResult, target, search: Search, out: Path, load: str) -> None:
    from loadtest.report.pages import versions, write_html
    from loadtest.report.report import MAX_ERROR_FRACTION

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

"""`rtxserve capacity`: the highest open-loop load a box holds within an SLO, and how many such boxes a target load
needs.

The search is AIPerf's adaptive scale as a ramp and a bisection: from `--start` requests/s the rate doubles while
each step holds, then the interval between the last step that held and the first that did not is halved until it is
narrower than `--precision` (a fraction of the rate). A step holds when its P99 meets every limit of the SLO, at most
`--max-errors` of its requests failed and it was not over-saturated (sweep.over_saturated: completing less than it was
sent, or arrivals held by the in-flight cap). A step stops early when it is plainly over-saturated: locust's running
median over twice the SLO's end-to-end limit, or most requests failing, three seconds in a row. Then confirm runs at
0.9x and 1.1x the answer check it: the first should hold, the second not.

The load is a scenario's (`--rate` set per step) or a trace's (`--trace`: its recorded arrivals, `--speed` set so
that its mean rate is the step's).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.slo import parse_slo

from .runner import LoadSpec, run
from .sweep import _figures, over_saturated

CONFIRM = (0.9, 1.1)
EARLY_READINGS = 3  # seconds in a row a step must look over-saturated before it is stopped


@dataclass
class CapacityResult:
    steps: list[dict]
    answer: float | None  # requests/s held within the SLO; None when the first step already missed it
    boxes: dict | None  # for --target-rps: the arithmetic
    headline: str
    report: Path


def _base_rate(spec: LoadSpec) -> float:
    """A trace's mean rate at speed 1 (requests/s)."""
    trace = spec.trace
    return len(trace.requests) / max(trace.duration_s * spec.options["speed"], 1e-3)


def _at(spec: LoadSpec, rps: float) -> LoadSpec:
    step = copy.deepcopy(spec)
    if spec.replaying:  # the trace at the step's rate, pass after pass for the step's duration
        step.options |= {"speed": rps / _base_rate(spec), "loop_trace": True}
        step.__dict__.pop("trace", None)  # read again at the new speed
    else:
        step.options["rate"] = rps
    return step


def early_stop(slo: dict[str, float]):
    """A check on locust's latest stats row (runner.run's `stop_early`): why the step is plainly over-saturated, when
    it has looked so for EARLY_READINGS readings in a row, else ''."""
    streak = {"n": 0}

    def check(row: dict) -> str:
        try:
            median, rps, failed = float(row["50%"]), float(row["Requests/s"]), float(row["Failures/s"])
        except (KeyError, ValueError):  # "N/A" before the first answers
            return ""
        why = ""
        if "e2el" in slo and median > 2 * slo["e2el"]:
            why = f"the running median latency ({median:.0f} ms) was over twice the SLO's {slo['e2el']:g} ms"
        elif rps > 0 and failed > 0.5 * rps:
            why = "most requests were failing"
        streak["n"] = streak["n"] + 1 if why else 0
        return f"{why} for {EARLY_READINGS} s" if streak["n"] >= EARLY_READINGS else ""

    return check


def _step(spec: LoadSpec, rps: float, phase: str, out: Path, done: list[dict], max_errors: float, log) -> dict:
    slo = parse_slo(spec.slo)
    name = f"step-{len(done) + 1:02d}-{phase}-{rps:.3g}"
    log(f"{phase} {len(done) + 1}: {rps:.3g} req/s")
    result = run(_at(spec, rps), out / name, log=lambda m: log(f"  {m}"), stop_early=early_stop(slo))
    figures = _figures(rps, spec, result.summary) | {"phase": phase, "report": f"{name}/report.md"}
    stopped = result.summary.settings.get("stopped early")
    # Kept up: the answers' rate counted over the sending window plus a typical answer's time (its P50), not plus the
    # last one's: in a step of a few seconds, one slow last answer would otherwise read as a backlog.
    s = result.summary
    kept = (s.requests - s.errors) / max(s.duration_s - (s.latency_ms.get("p50") or 0) / 1000, 1e-3)
    saturated = stopped or over_saturated([figures | {"qps": kept}], True, slo)
    within = result.summary.goodput.get("p99_within_slo", True)
    figures["holds"] = bool(figures["error_fraction"] <= max_errors and within and not saturated)
    figures["why_not"] = "" if figures["holds"] else (
        saturated or (f"{figures['error_fraction']:.1%} failed" if figures["error_fraction"] > max_errors else
                      "P99 over the SLO"))
    log(f"  {'holds' if figures['holds'] else 'misses: ' + figures['why_not']} (P99 {figures['p99_ms'] or math.nan:.1f} ms,"
        f" {figures['qps']:.2f} QPS)")
    done.append(figures)
    return figures


def check_bounds(start: float, precision: float, max_steps: int, max_errors: float = 0.01, headroom: float = 0.2) -> None:
    """Refuse a search that cannot run as asked (before any server starts)."""
    if start <= 0 or not 0 < precision < 1 or max_steps < 2 or not 0 <= max_errors < 1 or not 0 <= headroom < 1:
        raise ValueError("need --start > 0, 0 < --precision < 1, --max-steps >= 2, 0 <= --max-errors < 1 and "
                         "0 <= --headroom < 1")


def search(spec: LoadSpec, out: Path, *, start: float = 1.0, precision: float = 0.1, max_steps: int = 12,
           max_errors: float = 0.01, confirm: bool = True, target_rps: float | None = None, headroom: float = 0.2,
           log=print) -> CapacityResult:
    """Ramp, bisect, confirm (module doc); write capacity.md/.html/.png/.json into `out`."""
    if not spec.slo:
        raise ValueError("capacity needs an SLO (--slo e2el:MS, ttft:MS, ...): the load it holds is judged by it")
    check_bounds(start, precision, max_steps, max_errors, headroom)
    if target_rps is not None and target_rps <= 0:
        raise ValueError("--target-rps must be > 0")
    if not spec.open_loop:
        raise ValueError("capacity offers requests at a rate: give --arrival poisson or gamma, or --trace")
    _at(spec, start).check()
    out.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    low, high, rps = None, None, start
    while len(done) < max_steps:  # ramp
        if _step(spec, rps, "ramp", out, done, max_errors, log)["holds"]:
            low, rps = rps, rps * 2
        else:
            high = rps
            break
    while low is not None and high is not None and high / low - 1 > precision and len(done) < max_steps:  # bisect
        middle = (low + high) / 2
        if _step(spec, middle, "bisect", out, done, max_errors, log)["holds"]:
            low = middle
        else:
            high = middle
    if low is not None and confirm:
        for factor in CONFIRM:
            _step(spec, low * factor, f"confirm-{factor:g}x", out, done, max_errors, log)
    boxes = _boxes(low, target_rps, headroom) if low is not None and target_rps else None
    line = _headline(spec, low, high, done, boxes)
    report = _write(out, spec, done, low, high, boxes, line)
    return CapacityResult(done, low, boxes, line, report)


def _boxes(answer: float, target: float, headroom: float) -> dict:
    usable = answer * (1 - headroom)
    return {"target_rps": target, "per_box_rps": answer, "headroom": headroom, "usable_per_box_rps": usable,
            "boxes": math.ceil(target / usable)}


def _headline(spec: LoadSpec, low: float | None, high: float | None, steps: list[dict], boxes: dict | None) -> str:
    slo = ", ".join(f"P99 {k} ≤ {v:g} ms" for k, v in parse_slo(spec.slo).items())
    if low is None:
        first = steps[0]
        return (f"the lowest step, {first['load']:.3g} req/s, already misses the SLO ({slo}): {first['why_not']}; "
                f"P99 {first['p99_ms'] or math.nan:.1f} ms, {first['errors']} of {first['requests']} failed")
    what = f"this traffic ({Path(spec.options['trace']).name})" if spec.replaying else f"{spec.options['scenario']}"
    line = f"this box holds {low:.3g} requests/s of {what} at {slo}"
    line += f" (it missed at {high:.3g})" if high is not None else " (the highest step tried; it never missed)"
    confirms = {s["phase"]: s["holds"] for s in steps if s["phase"].startswith("confirm")}
    if confirms:
        upheld = confirms.get("confirm-0.9x") and not confirms.get("confirm-1.1x")
        line += "; confirmed: 0.9x holds, 1.1x misses" if upheld else (
            f"; the confirm runs disagree (0.9x {'holds' if confirms.get('confirm-0.9x') else 'misses'}, 1.1x "
            f"{'holds' if confirms.get('confirm-1.1x') else 'misses'}): the box is noisy near its limit")
    if boxes:
        line += (f". For {boxes['target_rps']:g} requests/s you need {boxes['boxes']} such box"
                 f"{'es' if boxes['boxes'] > 1 else ''}")
    return line


def plot(steps: list[dict], low: float | None, slo: dict, path: Path, title: str) -> Path:
    """The search path (each step's rate, held or missed, in order) beside P99 against the rate."""
    from .report.plots import pyplot, save

    plt = pyplot()
    fig, (path_ax, p99_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    n = np.arange(1, len(steps) + 1)
    loads = [s["load"] for s in steps]
    path_ax.plot(n, loads, color="gray", lw=1, zorder=1)
    for held, colour, label in ((True, "tab:green", "holds"), (False, "tab:red", "misses")):
        pick = [i for i, s in enumerate(steps) if s["holds"] == held]
        path_ax.scatter(n[pick], [loads[i] for i in pick], color=colour, s=50, label=label, zorder=2)
    for i, s in enumerate(steps):
        path_ax.annotate(s["phase"], (n[i], loads[i]), textcoords="offset points", xytext=(5, -10), fontsize=7)
    if low is not None:
        path_ax.axhline(low, color="tab:green", ls="--", lw=1, label=f"answer {low:.3g} req/s")
    path_ax.set(xlabel="step", ylabel="offered requests/s", title="the search, step by step")
    path_ax.set_xticks(n)
    path_ax.legend(fontsize=8)
    order = np.argsort(loads)
    p99 = np.array([np.nan if s["p99_ms"] is None else s["p99_ms"] for s in steps])
    p99_ax.plot(np.array(loads)[order], p99[order], color="tab:orange", marker="o", label="P99 (end to end)")
    for name, limit in slo.items():
        p99_ax.axhline(limit, color="red", ls="--", lw=1, label=f"SLO {name} {limit:g} ms")
    p99_ax.set(xlabel="offered requests/s", ylabel="ms", title="P99 against the offered load", yscale="log")
    p99_ax.legend(fontsize=8)
    return save(fig, path, title)


def _write(out: Path, spec: LoadSpec, steps: list[dict], low, high, boxes, line: str) -> Path:
    from .report.pages import versions, write_html

    slo = parse_slo(spec.slo)
    (out / "capacity.json").write_text(json.dumps({"answer_rps": low, "missed_at_rps": high, "boxes": boxes,
                                                   "headline": line, "steps": steps, "settings": spec.settings(),
                                                   "versions": versions()}, indent=2, default=str))
    title = f"rtxserve capacity: {Path(spec.options['trace']).name if spec.replaying else spec.options['scenario']}"
    plot(steps, low, slo, out / "capacity.png", title)
    fmt = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    rows = "\n".join(f"| {i} | {s['phase']} | {s['load']:.3g} | {s['sent_rps']:.2f} | {s['qps']:.2f} | {fmt(s['p99_ms'])} | "
                     f"{s['errors']}/{s['requests']} | {'yes' if s['holds'] else 'no: ' + s['why_not']} | "
                     f"[report]({s['report']}) |" for i, s in enumerate(steps, 1))
    arithmetic = ""
    if boxes:
        arithmetic = (f"\n## Boxes\n\n{boxes['target_rps']:g} requests/s ÷ ({boxes['per_box_rps']:.3g} requests/s a box × "
                      f"(1 − {boxes['headroom']:.0%} headroom) = {boxes['usable_per_box_rps']:.3g}) = "
                      f"{boxes['target_rps'] / boxes['usable_per_box_rps']:.2f}, rounded up: **{boxes['boxes']} "
                      f"box{'es' if boxes['boxes'] > 1 else ''}**, each serving the same models behind a load "
                      "balancer. Headroom keeps each box below the rate "
                      "where its P99 broke: for a box down, for bursts above the mean.\n")
    settings = "\n".join(f"| {k} | {v} |" for k, v in spec.settings().items())
    md = f"""# {title}

**{line}.**

![the search path and P99 against the load](capacity.png)

| step | phase | offered req/s | sent req/s | QPS | P99 ms | errors | holds | report |
|---|---|---|---|---|---|---|---|---|
{rows}

A step holds when its P99 meets the SLO ({", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items())}), few enough of its
requests failed and it kept up with what it was sent. The ramp doubles the rate while steps hold; the bisection
halves the interval between the last that held and the first that did not; the confirm runs, at 0.9x and 1.1x the
answer, should hold and miss.
{arithmetic}
| setting | value |
|---|---|
{settings}
"""
    path = out / "capacity.md"
    path.write_text(md)
    write_html(md, out, title, "capacity.html")
    return path

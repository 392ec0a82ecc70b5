"""`rtxserve loadtest sweep`: raise the load step by step and answer "what does this box hold?".

Each step is a whole run (its own report in step-NN-*/). The sweep stops early once the server is
over-saturated: in an open loop when it completes less than 90 % of the requests sent per second or more than 10 %
of the requests fail; in a closed loop when more users bring under 5 % more throughput while P99 grows
by half; with an SLO, after two steps in a row whose P99 is over twice a limit. Ctrl-C ends the sweep
and writes the report for the steps done.

The report gives the highest load whose P99 met the SLO (and at most 1 % errors), the knee of the
latency curve (Kneedle, from the `kneed` package), the load of maximum goodput, and both curves.
"""

from __future__ import annotations

import copy
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.slo import parse_slo

from .report.report import MAX_ERROR_FRACTION
from .runner import LoadSpec, run



@dataclass
class SweepResult:
    steps: list[dict]
    verdict: dict
    report: Path
    headline: str
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)


def step_values(steps: str, start: float, max_steps: int) -> list[float] | None:
    """The given values, or None for doubling from `start`."""
    if not steps:
        if start <= 0 or max_steps < 1:
            raise ValueError("--start must be > 0 and --max-steps >= 1")
        return None
    try:
        values = [float(v) for v in steps.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values) or values != sorted(values):
        raise ValueError(f"--steps: expected increasing positive numbers, not {steps!r}")
    return values


def _step_spec(spec: LoadSpec, value: float) -> LoadSpec:
    step = copy.deepcopy(spec)
    if spec.open_loop:
        step.options["rate"] = value
    else:
        step.users = max(1, round(value))
    return step


def _figures(value: float, spec: LoadSpec, summary) -> dict:
    lat = summary.latency_ms
    errors = summary.errors / max(1, summary.requests)
    good = summary.goodput
    return {"load": value, "qps": summary.qps, "sent_rps": summary.sent_rps, "requests": summary.requests, "errors": summary.errors,
            "error_fraction": errors, "p50_ms": lat.get("p50"), "p90_ms": lat.get("p90"), "p99_ms": lat.get("p99"),
            "ttft_p99_ms": (summary.streaming.get("ttft_ms") or {}).get("p99"),
            "goodput_rps": good.get("goodput_rps", summary.qps),
            "slo_p99_ms": good.get("p99_ms"),
            "holds": errors <= MAX_ERROR_FRACTION and good.get("p99_within_slo", True),
            "late_fraction": _share(summary.late_arrivals, "requests"),
            "capped_fraction": _share(summary.late_arrivals, "capped")}


def _share(late: dict, key: str) -> float:
    """The share of the open-loop arrivals that left late (`requests`) or waited for the in-flight cap (`capped`)."""
    return late.get(key, 0) / max(1, late.get("of", 0))


def over_saturated(steps: list[dict], open_loop: bool, slo: dict) -> str:
    """Why the last step shows the server past saturation ('' if it does not)."""
    last = steps[-1]
    if last["error_fraction"] > 0.10:
        return f"{last['error_fraction']:.0%} of the requests failed"
    # first the cap: arrivals that waited for it were never offered as planned (a load generator that is late saturates
    # nothing), and then what was completed of what was sent says little
    if open_loop and last.get("capped_fraction", 0.0) > 0.10:
        return f"{last['capped_fraction']:.0%} of the arrivals waited for the in-flight cap"
    if open_loop and last["qps"] < 0.9 * last["sent_rps"]:
        return f"it completed {last['qps']:.1f} of the {last['sent_rps']:.1f} requests/s sent"
    if not open_loop and len(steps) > 1:
        before = steps[-2]
        if last["qps"] < 1.05 * before["qps"] and (last["p99_ms"] or 0) > 1.5 * (before["p99_ms"] or np.inf):
            return f"{last['load']:g} users gave {last['qps']:.1f} QPS (vs {before['qps']:.1f}) at a P99 of {last['p99_ms']:.0f} ms"
    if slo and len(steps) > 1 and all(_far_over(s, slo) for s in steps[-2:]):
        return "P99 was over twice the SLO two steps in a row"
    return ""


def _far_over(step: dict, slo: dict) -> bool:
    p99 = step.get("slo_p99_ms") or {}
    return any(p99.get(k) is not None and p99[k] > 2 * v for k, v in slo.items())


def knee(steps: list[dict]) -> dict | None:
    """The step where P99 latency bends upward (Kneedle on P99 vs load), or None with fewer than 3 steps or no bend."""
    from kneed import KneeLocator

    points = [(s["load"], s["p99_ms"]) for s in steps if s["p99_ms"] is not None]
    if len(points) < 3:
        return None
    x, y = zip(*points)
    found = KneeLocator(x, y, curve="convex", direction="increasing").knee
    return next((s for s in steps if s["load"] == found), None) if found is not None else None


def verdict(steps: list[dict], slo: dict) -> dict:
    held = [s for s in steps if s["holds"]]
    best = max((s for s in steps if s["goodput_rps"] is not None), key=lambda s: s["goodput_rps"], default=None)
    bend = knee(steps)
    return {"max_load_within_slo": held[-1]["load"] if held else None,
            "max_qps_within_slo": max((s["qps"] for s in held), default=None),
            "knee_load": bend["load"] if bend else None, "knee_qps": bend["qps"] if bend else None,
            "max_goodput_load": best["load"] if best else None, "max_goodput_rps": best["goodput_rps"] if best else None,
            "slo_ms": slo}


def sweep(spec: LoadSpec, out: Path, *, steps: str = "", start: float = 1.0, max_steps: int = 8, log=print) -> SweepResult:
    """Run the steps (each a full run into out/step-NN-VALUE/), stop when over-saturated, write the report."""
    given = step_values(steps, start, max_steps)
    slo = parse_slo(spec.slo)
    value = given[0] if given else start
    _step_spec(spec, value).check()
    unit = "req/s" if spec.open_loop else "users"
    done: list[dict] = []
    notes, interrupted = [], False
    out.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(len(given) if given else max_steps):
            value = given[i] if given else value
            log(f"step {i + 1}: {value:g} {unit}")
            result = run(_step_spec(spec, value), out / f"step-{i + 1:02d}-{value:g}", log=lambda m: log(f"  {m}"))
            done.append(_figures(value, spec, result.summary) | {"report": str(result.report.relative_to(out))})
            if (busy := done[-1]["late_fraction"] - done[-1]["capped_fraction"]) > 0.10:
                notes.append(f"At {value:g} {unit}, {busy:.0%} of the arrivals left late because the load generator was "
                             "busy: less than that was offered (run with more --workers, or on another box).")
                log(notes[-1])
            reason = over_saturated(done, spec.open_loop, slo)
            if reason:
                notes.append(f"Stopped after {value:g} {unit}: over-saturated ({reason}).")
                log(notes[-1])
                break
            value *= 2
    except KeyboardInterrupt:
        interrupted = True
        notes.append(f"Interrupted during the step at {value:g} {unit}; the report covers the {len(done)} steps done.")
        log(notes[-1])
    except (RuntimeError, ValueError) as exc:  # locust failed, the server went away...: keep what was measured
        if not done:
            raise
        notes.append(f"The step at {value:g} {unit} failed ({str(exc).splitlines()[0]}); the report covers the "
                     f"{len(done)} steps before it.")
        log(notes[-1])
    if not done:
        raise RuntimeError("the sweep was stopped before any step ended")
    result = verdict(done, slo)
    report = write(out, spec, done, result, notes, unit)
    return SweepResult(done, result, report, headline(result, unit, done), interrupted, notes)


def headline(result: dict, unit: str, steps: list[dict]) -> str:
    if result["max_load_within_slo"] is None:
        low = steps[0]
        return (f"no step met the SLO (P99 and at most {MAX_ERROR_FRACTION:.0%} errors); the lowest, {low['load']:g} {unit}, "
                f"had P99 {low['p99_ms'] or float('nan'):.1f} ms and {low['errors']} errors")
    line = f"max load within the SLO: {result['max_load_within_slo']:g} {unit} ({result['max_qps_within_slo']:.1f} QPS)"
    if result["knee_load"] is not None:
        line += f"; knee at {result['knee_load']:g} {unit} ({result['knee_qps']:.1f} QPS)"
    if result["max_goodput_rps"] is not None:
        line += f"; max goodput {result['max_goodput_rps']:.1f} req/s at {result['max_goodput_load']:g} {unit}"
    return line


def plot(steps: list[dict], result: dict, path: Path, title: str, unit: str) -> Path:
    from .report.plots import pyplot, save

    plt = pyplot()
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(13, 4.8))
    qps = [s["qps"] for s in steps]
    for key, colour in (("p50_ms", "tab:green"), ("p90_ms", "tab:purple"), ("p99_ms", "tab:orange")):
        ax_l.plot(qps, [np.nan if s[key] is None else s[key] for s in steps], marker="o", color=colour,
                  label=key.split("_")[0].upper())
    for name, limit in result["slo_ms"].items():
        ax_l.axhline(limit, color="red", linestyle="--", linewidth=1, label=f"SLO {name} {limit:g} ms")
    if result["knee_qps"] is not None:
        knee_step = next(s for s in steps if s["load"] == result["knee_load"])
        ax_l.scatter([knee_step["qps"]], [knee_step["p99_ms"]], s=160, facecolors="none", edgecolors="black",
                     label=f"knee ({result['knee_load']:g} {unit})", zorder=5)
    for s in steps:
        if s["p99_ms"] is not None:  # a step where nothing succeeded has no latency to show
            ax_l.annotate(f"{s['load']:g}", (s["qps"], s["p99_ms"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax_l.set_xlabel("achieved QPS (labels: offered load)")
    ax_l.set_ylabel("latency (ms)")
    ax_l.set_yscale("log")
    ax_l.set_title("latency vs throughput")
    ax_l.legend(fontsize=8)
    loads = [s["load"] for s in steps]
    ax_g.plot(loads, qps, marker="o", color="tab:blue", label="achieved QPS")
    good = [s["goodput_rps"] for s in steps]
    if any(g is not None for g in good):
        ax_g.plot(loads, [np.nan if g is None else g for g in good], marker="s", color="tab:green", label="goodput (within SLO)")
    if unit == "req/s":
        ax_g.plot(loads, loads, linestyle=":", color="gray", label="offered")
    ax_g.set_xlabel(f"offered load ({unit})")
    ax_g.set_ylabel("requests / s")
    ax_g.set_ylim(bottom=0)
    ax_g.set_title("throughput and goodput vs load")
    ax_g.legend(fontsize=8)
    return save(fig, path, title)


def write(out: Path, spec: LoadSpec, steps: list[dict], result: dict, notes: list[str], unit: str) -> Path:
    from .report.pages import versions, write_html

    (out / "sweep.json").write_text(json.dumps({"steps": steps, "verdict": result, "notes": notes,
                                                "settings": spec.settings(), "versions": versions()}, indent=2, default=str))
    columns = [k for k in steps[0] if k not in ("slo_p99_ms", "report")]
    with open(out / "steps.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([[s[k] for k in columns] for s in steps])
    title = f"rtxserve sweep: {spec.options['scenario']}, {unit}"
    plot(steps, result, out / "sweep.png", title, unit)
    fmt = lambda v, f=".1f": "–" if v is None else format(v, f)  # noqa: E731
    rows = "\n".join(f"| {s['load']:g} | {s['qps']:.1f} | {fmt(s['p50_ms'])} | {fmt(s['p99_ms'])} | {fmt(s['goodput_rps'])} | "
                     f"{s['errors']}/{s['requests']} | {'yes' if s['holds'] else 'no'} | [report]({s['report']}) |" for s in steps)
    settings = "\n".join(f"| {k} | {v} |" for k, v in spec.settings().items())
    md = f"""# {title}

**{headline(result, unit, steps)}**

{"".join(f"> {n}" + chr(10) + chr(10) for n in notes)}![latency vs throughput, goodput vs load](sweep.png)

| load ({unit}) | QPS | P50 ms | P99 ms | goodput req/s | errors | holds | step |
|---|---|---|---|---|---|---|---|
{rows}

"Holds": P99 within the SLO ({", ".join(f"{k} ≤ {v:g} ms" for k, v in result["slo_ms"].items()) or "none given"}) and at most
{MAX_ERROR_FRACTION:.0%} errors. The knee is where P99 bends upward (Kneedle); goodput counts the requests within every limit.

| setting | value |
|---|---|
{settings}
"""
    path = out / "sweep.md"
    path.write_text(md)
    write_html(md, out, title, "sweep.html")
    return path

"""One report for a whole promotion: promote.md, promote.html, promote.png (each step's P99 by role, and the
candidate's share), promote.json; each eval's own report beside it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loadtest.eval.report import write as write_eval
from loadtest.report.pages import markdown_table, write_html
from loadtest.report.plots import pyplot

from .driver import Outcome

ROLES = ("current", "candidate", "shadow")
COLOURS = {"current": "tab:blue", "candidate": "tab:orange", "shadow": "tab:gray"}


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def plot(outcome: Outcome, path: Path) -> Path:
    """Per step, each role's P99 (bars, ms) and the candidate's share of the requests (line)."""
    plt = pyplot()
    steps = [s for s in outcome.steps if s.name != "load"]
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(steps) + 2), 4))
    width = 0.8 / len(ROLES)
    for i, role in enumerate(ROLES):
        values = [s.figures[role].p99_ms if role in s.figures else 0.0 for s in steps]
        if any(values):
            ax.bar([x + (i - 1) * width for x in range(len(steps))], values, width, color=COLOURS[role],
                   label=f"{role} P99 (backend)")
    for x, s in enumerate(steps):
        if not s.passed:
            ax.annotate("breach", (x, 0), xytext=(x, ax.get_ylim()[1] * 0.9), ha="center", color="tab:red",
                        fontweight="bold")
    ax.set_xticks(range(len(steps)), [s.name for s in steps], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("P99 ms")
    share = ax.twinx()
    share.plot(range(len(steps)), [s.weight for s in steps], color="black", marker="o", label="candidate's share %")
    share.set_ylim(0, 105)
    share.set_ylabel("candidate's share of requests (%)")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = share.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, fontsize=8, loc="upper left")
    ax.set_title(f"{outcome.model}: {outcome.current} -> {outcome.candidate}: {outcome.result}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(outcome: Outcome, evals: dict[str, str]) -> str:
    o = outcome
    lines = [f"# Promotion of {o.model}: {o.current} -> {o.candidate}", "",
             f"**{o.result.upper()}**" + (f": {o.reason}" if o.reason else "") + ".", ""]
    if o.promotion:
        lines += [f"Promotion {o.promotion.get('id', '')}, the gateway's last word: {o.promotion.get('phase', '')}"
                  + (f" ({o.promotion['reason']})" if o.promotion.get("reason") else "") + ".", ""]
    rows = []
    for s in o.steps:
        f = s.figures
        cand = f.get("candidate") or f.get("shadow")
        rows.append([s.name, f"{s.seconds:.1f}", s.weight,
                     " / ".join(str(f[r].requests) if r in f else "0" for r in ROLES),
                     " / ".join(str(f[r].errors) if r in f else "0" for r in ROLES),
                     f"{_ms(f['current'].p50_ms)} / {_ms(f['current'].p99_ms)}" if "current" in f else "-",
                     f"{_ms(cand.p50_ms)} / {_ms(cand.p99_ms)}" if cand else "-",
                     "passed" if s.passed else "**BREACH**", (s.detail or "").replace("|", "\\|")])
    lines += ["## Steps", "", "Requests, errors and backend latency by role (current / candidate / shadow), from the "
              "gateway's own figures for the name under promotion.", "",
              markdown_table(rows, ["step", "s", "candidate %", "requests", "errors", "current P50 / P99 ms",
                                    "candidate (or shadow) P50 / P99 ms", "", "detail"]), "",
              "![each step's P99 by role and the candidate's share](promote.png)", ""]
    if evals:
        lines += ["## The eval gate", ""]
        for role, page in evals.items():
            result = o.evals[role]
            lines += [f"- {role} {result.model}: {result.verdict()} ([report]({page}))"]
        lines.append("")
    return "\n".join(lines)


def write(outcome: Outcome, out_dir: Path) -> Path:
    """The report in `out_dir`; returns promote.md's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    evals = {}
    for role, result in outcome.evals.items():
        write_eval(result, out_dir / f"eval-{role}")
        evals[role] = f"eval-{role}/eval.html"
    plot(outcome, out_dir / "promote.png")
    text = markdown(outcome, evals)
    (out_dir / "promote.md").write_text(text)
    write_html(text, out_dir, f"Promotion of {outcome.model}", name="promote.html")
    data = {"model": outcome.model, "current": outcome.current, "candidate": outcome.candidate,
            "result": outcome.result, "reason": outcome.reason, "promotion": outcome.promotion,
            "evals": {role: r.to_dict() for role, r in outcome.evals.items()},
            "steps": [{"name": s.name, "started": s.started, "seconds": s.seconds, "weight": s.weight, "passed": s.passed, "detail": s.detail,
                       "figures": {r: {k: v for k, v in vars(f).items() if k != "buckets"} for r, f in s.figures.items()}}
                      for s in outcome.steps]}
    (out_dir / "promote.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return out_dir / "promote.md"

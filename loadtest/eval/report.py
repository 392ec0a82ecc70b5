"""An eval's report: eval.md, eval.html (self-contained), eval.png (each input's drift against its threshold) and
eval.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..report.pages import markdown_table, write_html
from ..report.plots import pyplot
from .run import EvalResult


def _cell(text) -> str:
    """Text for a Markdown table cell: its pipes escaped (|Δlogit| would split the cell)."""
    return str(text).replace("|", "\\|")


def _figure(value: float) -> str:
    return "∞ (no answer)" if math.isinf(value) else f"{value:.3g}"


def plot(result: EvalResult, path: Path) -> Path:
    """One bar per input: its drift (log scale) against the threshold; an input whose answer disagrees (another label,
    continuation, ...) or that got none is a red bar drawn to the top."""
    plt = pyplot()
    drifts = np.array([a.drift for a in result.answers], dtype=float)
    agrees = np.array([a.agrees for a in result.answers])
    limit = result.limits["drift"] if math.isfinite(result.limits["drift"]) else 1.0
    finite = drifts[np.isfinite(drifts) & (drifts > 0)]
    floor = min(limit, finite.min() if finite.size else 1.0) / 10 or 1e-12
    top = max(limit, finite.max() if finite.size else 1.0) * 10
    shown = np.where(agrees & np.isfinite(drifts), np.maximum(drifts, floor), top)
    colours = ["tab:green" if ok and d <= limit else "tab:red" for ok, d in zip(agrees, drifts)]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(drifts) + 2), 3.6))
    ax.bar(range(1, len(drifts) + 1), shown, color=colours)
    ax.axhline(limit, color="black", linestyle="--", label=f"threshold {limit:.3g}")
    ax.set_yscale("log")
    ax.set_ylim(floor, top)
    ax.set_xlabel("input (red: past the threshold; to the top: disagrees, or no answer)")
    ax.set_ylabel(result.family.drift_name)
    ax.set_title(f"{result.model}: served against {result.reference.framework.split(',')[0]} "
                 f"({int(agrees.sum())} of {len(agrees)} agree)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: EvalResult, image: str | None = "eval.png") -> str:
    ref = result.reference
    lines = [f"# Eval: {result.model} ({ref.task})", "",
             f"**{'PASSED' if result.passed else 'DRIFTED'}**: the served answers of {result.model} at {result.url}, "
             f"against what {ref.framework} answered on {len(ref.items)} inputs ({ref.made_from}), {result.seconds:.1f} s.",
             "", markdown_table([[_cell(g.name), f"{g.value:.6g}", f"{'>=' if g.at_least else '<='} {g.limit:.6g}",
                                 "passed" if g.passed else "**FAILED**"] for g in result.gates],
                                ["gate", "measured", "threshold", ""]), ""]
    lines += [f"The reference: the checkpoint {ref.source or '(not recorded)'}, served as {ref.variant}"
              + (f"; export measured {', '.join(f'{k} {v:.3g}' for k, v in ref.drift.items())} on its own checks"
                 if ref.drift else "") + ".", ""]
    if result.gold:
        lines += [f"Against the right answers given with {int(result.gold['inputs'])} inputs: served "
                  f"{result.gold['served']:.1%} right"
                  + (f", the framework {result.gold['framework']:.1%}." if "framework" in result.gold else
                     " (no reference set: the framework's answers are not known, so drift is not measured).")]
    if image:
        lines += [f"![each input's drift]({image})", ""]
    rows = [[i + 1, _cell(name), "yes" if a.agrees else "**no**", _figure(a.drift), _cell(a.served), _cell(a.expected),
             _cell(a.detail)] for i, (name, a) in enumerate(zip(result.inputs, result.answers))]
    lines += ["## Each input", "", markdown_table(rows, ["#", "input", "agrees", _cell(result.family.drift_name), "served",
                                                         "expected (framework)", "detail"]), ""]
    return "\n".join(lines)


def write(result: EvalResult, out_dir: Path) -> Path:
    """eval.md, eval.html, eval.png and eval.json in `out_dir`; returns the Markdown's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(result, out_dir / "eval.png")
    text = markdown(result)
    (out_dir / "eval.md").write_text(text)
    write_html(text, out_dir, f"Eval: {result.model}", name="eval.html")
    (out_dir / "eval.json").write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return out_dir / "eval.md"

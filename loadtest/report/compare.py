"""`rtxserve loadtest compare BEFORE AFTER`: every figure of two runs (or two sweeps) side by side with its
change, and their curves overlaid: the latency distributions of two runs, the latency and goodput curves
of two sweeps. `rtxserve loadtest compare RUN` does the same for two models that answered one run: the targets of
an alias that split its traffic (a canary beside the version it may replace)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .pages import flat, write_html
from .plots import latency_cdf, pyplot, save
from .report import load_samples, measured


def _kind(folder: Path) -> str:
    if (folder / "sweep.json").exists():
        return "sweep"
    if (folder / "report.json").exists():
        return "run"
    raise ValueError(f"{folder} holds neither a run (report.json) nor a sweep (sweep.json)")


def _change(before, after) -> str:
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or isinstance(before, bool):
        return "" if before == after else "changed"
    if before == 0:
        return "" if after == 0 else "new"
    return f"{(after - before) / abs(before):+.1%}"


def _rows(before: dict, after: dict) -> list[list[str]]:
    fmt = lambda v: "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    return [[key, fmt(before.get(key)), fmt(after.get(key)), _change(before.get(key), after.get(key))]
            for key in [*before, *(k for k in after if k not in before)]]


def _run_figures(folder: Path) -> dict:
    return flat(json.loads((folder / "report.json").read_text()))


def _sweep_figures(folder: Path) -> dict:
    data = json.loads((folder / "sweep.json").read_text())
    figures = {f"verdict.{k}": v for k, v in data["verdict"].items() if not isinstance(v, dict)}
    for step in data["steps"]:
        figures |= {f"load {step['load']:g}: {k}": step[k] for k in ("qps", "p50_ms", "p99_ms", "goodput_rps", "errors")}
    return figures


def _measured_latencies(folder: Path, model: str | None = None) -> np.ndarray:
    """The latencies of a run's successful requests after its warm-up; of those `model` answered, if named."""
    samples = load_samples(folder / "samples.csv")
    use = samples.ok & measured(samples, json.loads((folder / "report.json").read_text())["warmup_s"])
    return samples.latency_ms[use & (samples.models == model)] if model is not None else samples.latency_ms[use]


def _plot_runs(before: Path, after: Path, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    latency_cdf(ax, [(f"{name} ({folder.name})", _measured_latencies(folder), colour)
                     for folder, name, colour in ((before, "before", "tab:blue"), (after, "after", "tab:orange"))])
    return save(fig, path, "latency distributions, before and after")


def _plot_sweeps(before: Path, after: Path, path: Path) -> Path:
    plt = pyplot()
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(13, 4.8))
    for folder, name, colour in ((before, "before", "tab:blue"), (after, "after", "tab:orange")):
        steps = json.loads((folder / "sweep.json").read_text())["steps"]
        ax_l.plot([s["qps"] for s in steps], [s["p99_ms"] for s in steps], marker="o", color=colour, label=f"{name} P99")
        ax_g.plot([s["load"] for s in steps], [s["goodput_rps"] for s in steps], marker="s", color=colour,
                  label=f"{name} goodput")
    ax_l.set(xlabel="achieved QPS", ylabel="P99 latency (ms)", yscale="log", title="latency vs throughput")
    ax_g.set(xlabel="offered load", ylabel="requests / s within the SLO", title="goodput vs load")
    ax_g.set_ylim(bottom=0)
    for ax in (ax_l, ax_g):
        ax.legend(fontsize=8)
    return save(fig, path, "sweeps, before and after")


def compare(before: Path, after: Path, out: Path) -> Path:
    """Write compare.md / compare.html / compare.png into `out`; returns the Markdown path."""
    kind = _kind(before)
    if _kind(after) != kind:
        raise ValueError(f"cannot compare a {kind} ({before}) with a {_kind(after)} ({after})")
    out.mkdir(parents=True, exist_ok=True)
    figures = _sweep_figures if kind == "sweep" else _run_figures
    (_plot_sweeps if kind == "sweep" else _plot_runs)(before, after, out / "compare.png")
    return _write(out, f"{before.name} → {after.name}", f"Before: `{before}`; after: `{after}` ({kind}s).",
                  _rows(figures(before), figures(after)))


def compare_models(run: Path, out: Path, models: tuple[str, str] | None = None) -> Path:
    """The same for two models that answered one run (`models`: which, first as before; default: the two that
    answered, when two did): their figures side by side and their latency distributions overlaid."""
    if _kind(run) != "run":
        raise ValueError(f"{run} is a sweep: compare two models within one run")
    by_model = json.loads((run / "report.json").read_text()).get("by_model") or {}
    if models is None:
        if len(by_model) != 2:
            raise ValueError(f"{len(by_model)} models answered the run in {run} ({', '.join(by_model) or 'none named'}): "
                             "name two with --models A,B" if by_model else
                             f"one model answered every request of the run in {run}: nothing to compare within it")
        models = tuple(by_model)
    unknown = [m for m in models if m not in by_model]
    if unknown:
        raise ValueError(f"no answer of the run in {run} names {', '.join(unknown)}; it has {', '.join(by_model)}")
    out.mkdir(parents=True, exist_ok=True)
    first, second = models
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    latency_cdf(ax, [(m, _measured_latencies(run, m), colour) for m, colour in ((first, "tab:blue"), (second, "tab:orange"))])
    save(fig, out / "compare.png", f"latency distributions: {first} and {second}, one run")
    return _write(out, f"{first} → {second}", f"Both answered the run in `{run}`, under the same load at the same time.",
                  _rows(flat(by_model[first]), flat(by_model[second])))


def _write(out: Path, title: str, what: str, rows: list[list[str]]) -> Path:
    table = "\n".join(f"| {' | '.join(r)} |" for r in rows)
    md = f"""# rtxserve compare: {title}

{what} The change is (after − before) / before.

![the two overlaid](compare.png)

| figure | before | after | change |
|---|---|---|---|
{table}
"""
    path = out / "compare.md"
    path.write_text(md)
    write_html(md, out, f"rtxserve compare: {title}", "compare.html")
    return path

"""The run's plots: latency over time beside its distribution, and streaming figures (TTFT, inter-token gaps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .report import Samples, Summary, measured, pooled_gaps


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _distribution(ax, values: np.ndarray, marks: dict[str, float], unit: str, limit: float) -> None:
    """Histogram and cumulative fraction of `values` up to `limit`, with the percentiles in `marks` drawn."""
    values = np.sort(values)
    if not len(values):
        return
    # A few outliers would squash the body of the distribution: cut the axis, say what was cut.
    shown = values <= limit
    beyond = int((~shown).sum())
    ax.hist(values[shown], bins=60, color="tab:blue", alpha=0.6)
    if beyond:
        ax.text(0.98, 0.5, f"{beyond} value(s) > {limit:.0f} {unit}\n(max {values[-1]:.0f} {unit}) not shown",
                transform=ax.transAxes, ha="right", fontsize=8)
    ax_c = ax.twinx()
    ax_c.plot(values[shown], (np.arange(1, len(values) + 1) / len(values))[shown], color="black", linewidth=1)
    ax_c.set_ylabel("cumulative fraction")
    for name, color in (("p50", "tab:green"), ("p90", "tab:purple"), ("p99", "tab:orange")):
        if name in marks:
            ax.axvline(marks[name], color=color, linestyle="--", label=f"{name} {marks[name]:.1f} {unit}")
    ax.legend(fontsize=8)


def _time_axis(ax, summary: Summary, ylabel: str, title: str) -> None:
    """Labels of a per-request-over-time panel, with the warm-up shaded."""
    if summary.warmup_s:
        ax.axvspan(0, summary.warmup_s, color="gray", alpha=0.1, label="warm-up (excluded)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title)


def save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def per_second(samples: Samples) -> dict[str, np.ndarray]:
    """Per-second P50 / P99 latency and QPS of the successful requests, by start time since the first one."""
    t = samples.start - samples.start.min()
    seconds = np.floor(t).astype(int)
    ok = samples.ok
    xs, p50, p99, qps = [], [], [], []
    for s in np.unique(seconds):
        lat = samples.latency_ms[(seconds == s) & ok]
        if len(lat):
            xs.append(s + 0.5)
            p50.append(np.percentile(lat, 50))
            p99.append(np.percentile(lat, 99))
            qps.append(len(lat))
    return {"t": np.array(xs), "p50": np.array(p50), "p99": np.array(p99), "qps": np.array(qps)}


def plot(samples: Samples, summary: Summary, path: Path, title: str) -> Path:
    """Latency over time (each request, with per-second P50/P99 and QPS) beside the latency distribution."""
    plt = pyplot()
    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(13, 4.8))
    t = samples.start - samples.start.min() if len(samples.end) else samples.start
    ok = samples.ok
    ax_t.scatter(t[ok], samples.latency_ms[ok], s=3, alpha=0.25, color="tab:blue", label="request")
    if (~ok).any():
        ax_t.scatter(t[~ok], samples.latency_ms[~ok], s=8, color="tab:red", marker="x", label="error")
    if len(t):
        client = per_second(samples)
        ax_t.plot(client["t"], client["p50"], color="tab:green", label="P50 per second")
        ax_t.plot(client["t"], client["p99"], color="tab:orange", label="P99 per second")
        ax_q = ax_t.twinx()
        ax_q.plot(client["t"], client["qps"], color="gray", linestyle=":", label="QPS")
        ax_q.set_ylabel("requests / s (dotted)")
        ax_q.set_ylim(bottom=0)
    _time_axis(ax_t, summary, "latency (ms)", "latency over time")
    if len(samples.end):
        lat = samples.latency_ms[ok & measured(samples, summary.warmup_s)]
        if len(lat):
            _distribution(ax_d, lat, summary.latency_ms, "ms", 1.5 * summary.latency_ms.get("p99.9", lat.max()))
    ax_d.set_xlabel("latency (ms)")
    ax_d.set_ylabel("requests")
    ax_d.set_title("latency distribution (after warm-up)")
    return save(fig, path, title)


def plot_streaming(samples: Samples, summary: Summary, path: Path, title: str) -> Path:
    """TTFT of each request over time, then the TTFT and inter-token gap distributions after warm-up."""
    plt = pyplot()
    fig, (ax_t, ax_f, ax_i) = plt.subplots(1, 3, figsize=(16, 4.8))
    use = samples.ok & samples.streamed & np.isfinite(samples.ttft_ms)
    t = samples.start - samples.start.min()
    ax_t.scatter(t[use], samples.ttft_ms[use], s=4, alpha=0.4, color="tab:blue", label="request")
    _time_axis(ax_t, summary, "time to first token (ms)", "TTFT over time")
    kept = use & measured(samples, summary.warmup_s)
    for ax, values, name, what in (
        (ax_f, samples.ttft_ms[kept], "ttft_ms", "time to first token"),
        (ax_i, pooled_gaps(samples, kept), "itl_ms", "inter-token gap"),
    ):
        marks = summary.streaming.get(name, {})
        if len(values):
            _distribution(ax, values, marks, "ms", 1.5 * marks.get("p99", values.max()))
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("requests" if name == "ttft_ms" else "gaps")
        ax.set_title(f"{what} distribution (after warm-up)")
    return save(fig, path, title)



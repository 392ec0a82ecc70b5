"""Turn raw per-request samples into figures (P50/P90/P99/P99.9, QPS, errors), a plot and a report."""

from __future__ import annotations

import csv
import glob
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99, 99.9)


@dataclass
class Samples:
    end: np.ndarray  # epoch seconds
    latency_ms: np.ndarray
    ok: np.ndarray  # bool
    errors: list[str]

    @property
    def start(self) -> np.ndarray:
        return self.end - self.latency_ms / 1000.0


def load_samples(prefix: str | Path) -> Samples:
    """Read every `<prefix>.<pid>` file the locust processes wrote."""
    rows = []
    for path in sorted(glob.glob(f"{prefix}.*")):
        with open(path, newline="") as f:
            rows += [r for r in csv.reader(f) if len(r) == 5]
    rows.sort(key=lambda r: float(r[0]))
    return Samples(
        end=np.array([float(r[0]) for r in rows]),
        latency_ms=np.array([float(r[2]) for r in rows]),
        ok=np.array([r[3] == "1" for r in rows], dtype=bool),
        errors=[r[4] for r in rows if r[3] != "1"],
    )


def nearest_rank(sorted_values: np.ndarray, percentile: float) -> float:
    """The value at rank ceil(p% * n), as HDR histograms report: a latency that was observed,
    never an interpolation. (The 1e-9 absorbs float error such as 99.9 / 100 * 1000 = 999.0000000000001.)"""
    n = len(sorted_values)
    rank = min(n, max(1, math.ceil(percentile / 100 * n - 1e-9)))
    return float(sorted_values[rank - 1])


@dataclass
class Summary:
    requests: int
    errors: int
    duration_s: float
    qps: float  # successful requests per second in the measured window
    latency_ms: dict[str, float]  # p50/p90/p99/p99.9/mean/max of successful requests
    warmup_s: float
    error_kinds: dict[str, int] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(samples: Samples, warmup_s: float = 0.0, settings: dict | None = None) -> Summary:
    """Figures over the window after `warmup_s`; percentiles from the sorted raw latencies."""
    if len(samples.end) == 0:
        return Summary(0, 0, 0.0, 0.0, {}, warmup_s, {}, settings or {})
    t0 = samples.start.min() + warmup_s
    keep = samples.start >= t0
    if not keep.any():
        raise ValueError(f"no request started after the {warmup_s}s warm-up; run longer or shorten --warmup")
    ok = samples.ok[keep]
    lat = np.sort(samples.latency_ms[keep][ok])
    duration = float(samples.end[keep].max() - t0)
    figures = {}
    if len(lat):
        figures = {f"p{p:g}": nearest_rank(lat, p) for p in PERCENTILES}
        figures |= {"mean": float(lat.mean()), "max": float(lat.max()), "min": float(lat.min())}
    kept_errors = [e for e, k in zip(samples.errors, keep[~samples.ok]) if k]
    return Summary(
        requests=int(keep.sum()),
        errors=int((~ok).sum()),
        duration_s=duration,
        qps=float(ok.sum() / duration) if duration > 0 else 0.0,
        latency_ms=figures,
        warmup_s=warmup_s,
        error_kinds=dict(Counter(e.split(":")[0] or "unknown" for e in kept_errors).most_common(10)),
        settings=settings or {},
    )


def plot(samples: Samples, summary: Summary, path: Path, title: str) -> Path:
    """Latency over time (each request, with per-second P50/P99 and QPS) beside the latency distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(13, 4.8))
    t = samples.start - samples.start.min() if len(samples.end) else samples.start
    ok = samples.ok
    ax_t.scatter(t[ok], samples.latency_ms[ok], s=3, alpha=0.25, color="tab:blue", label="request")
    if (~ok).any():
        ax_t.scatter(t[~ok], samples.latency_ms[~ok], s=8, color="tab:red", marker="x", label="error")
    if len(t):
        seconds = np.floor(t).astype(int)
        xs, p50, p99, qps = [], [], [], []
        for s in np.unique(seconds):
            lat = samples.latency_ms[(seconds == s) & ok]
            if len(lat):
                xs.append(s + 0.5)
                p50.append(np.percentile(lat, 50))
                p99.append(np.percentile(lat, 99))
                qps.append(len(lat))
        ax_t.plot(xs, p50, color="tab:green", label="P50 per second")
        ax_t.plot(xs, p99, color="tab:orange", label="P99 per second")
        ax_q = ax_t.twinx()
        ax_q.plot(xs, qps, color="gray", linestyle=":", label="QPS")
        ax_q.set_ylabel("requests / s (dotted)")
        ax_q.set_ylim(bottom=0)
    if summary.warmup_s:
        ax_t.axvspan(0, summary.warmup_s, color="gray", alpha=0.1, label="warm-up (excluded)")
    ax_t.set_xlabel("time since start (s)")
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_ylim(bottom=0)
    ax_t.legend(loc="upper left", fontsize=8)
    ax_t.set_title("latency over time")
    lat = np.sort(samples.latency_ms[ok])
    if len(lat):
        # A few outliers would squash the body of the distribution: cut the axis, say what was cut.
        limit = 1.5 * summary.latency_ms.get("p99.9", lat[-1])
        beyond = int((lat > limit).sum())
        ax_d.hist(lat[lat <= limit], bins=60, color="tab:blue", alpha=0.6)
        if beyond:
            ax_d.text(0.98, 0.5, f"{beyond} request(s) > {limit:.0f} ms\n(max {lat[-1]:.0f} ms) not shown",
                      transform=ax_d.transAxes, ha="right", fontsize=8)
        ax_c = ax_d.twinx()
        shown = lat <= limit
        ax_c.plot(lat[shown], (np.arange(1, len(lat) + 1) / len(lat))[shown], color="black", linewidth=1)
        ax_c.set_ylabel("cumulative fraction")
        for name, color in (("p50", "tab:green"), ("p90", "tab:purple"), ("p99", "tab:orange")):
            if name in summary.latency_ms:
                ax_d.axvline(summary.latency_ms[name], color=color, linestyle="--", label=f"{name} {summary.latency_ms[name]:.1f} ms")
        ax_d.legend(fontsize=8)
    ax_d.set_xlabel("latency (ms)")
    ax_d.set_ylabel("requests")
    ax_d.set_title("latency distribution (after warm-up)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def headline(summary: Summary) -> str:
    lat = summary.latency_ms
    if not lat:
        return f"no successful request ({summary.requests} requests, {summary.errors} errors)"
    return (f"P50 {lat['p50']:.1f} ms, P90 {lat['p90']:.1f} ms, P99 {lat['p99']:.1f} ms, "
            f"QPS {summary.qps:.1f}, errors {summary.errors}/{summary.requests}")


def write_report(summary: Summary, samples: Samples, out_dir: Path, title: str) -> Path:
    """Write report.json, latency.png and report.md into `out_dir`; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(summary.to_dict(), indent=2))
    plot(samples, summary, out_dir / "latency.png", title)
    lat = summary.latency_ms
    rows = "\n".join(f"| {k.upper()} | {v:.2f} |" for k, v in lat.items())
    settings = "\n".join(f"| {k} | {v} |" for k, v in summary.settings.items())
    errors = "\n".join(f"- {k}: {v}" for k, v in summary.error_kinds.items()) or "- none"
    md = f"""# {title}

**{headline(summary)}**

![latency over time and distribution](latency.png)

Measured window: {summary.duration_s:.1f} s after a {summary.warmup_s:g} s warm-up; {summary.requests} requests,
{summary.errors} errors. Percentiles are computed from every request's own latency (raw samples),
not from locust's rounded buckets. QPS counts successful requests.

| latency | ms |
|---|---|
{rows}

| setting | value |
|---|---|
{settings}

Errors by kind:
{errors}
"""
    path = out_dir / "report.md"
    path.write_text(md)
    return path

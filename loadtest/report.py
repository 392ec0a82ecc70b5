"""Turn raw per-request samples into figures (P50/P90/P99/P99.9, QPS, errors), a plot and a report.

Streamed runs (rows that carry time to first token, inter-token gaps and output tokens) also get
TTFT / ITL / TPOT / output tokens/s figures and a second plot.
"""

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
STREAM_PERCENTILES = (50, 90, 99)
BASE_COLUMNS, STREAM_COLUMNS = 5, 8  # see loadtest/scenarios/samples.py


@dataclass
class Samples:
    end: np.ndarray  # epoch seconds
    latency_ms: np.ndarray
    ok: np.ndarray  # bool
    errors: list[str]
    # Streaming figures, NaN / empty where a request has none (not streamed, failed, or no text).
    ttft_ms: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    itl_ms: list[np.ndarray] | None = None

    @property
    def start(self) -> np.ndarray:
        return self.end - self.latency_ms / 1000.0

    @property
    def streamed(self) -> np.ndarray:
        """Which requests carry streaming figures."""
        if self.output_tokens is None:
            return np.zeros(len(self.end), dtype=bool)
        return np.isfinite(self.output_tokens)


def load_samples(prefix: str | Path) -> Samples:
    """Read every `<prefix>.<pid>` file the locust processes wrote (plain and streamed rows alike)."""
    rows = []
    for path in sorted(glob.glob(f"{prefix}.*")):
        with open(path, newline="") as f:
            rows += [r for r in csv.reader(f) if len(r) in (BASE_COLUMNS, STREAM_COLUMNS)]
    rows.sort(key=lambda r: float(r[0]))
    samples = Samples(
        end=np.array([float(r[0]) for r in rows]),
        latency_ms=np.array([float(r[2]) for r in rows]),
        ok=np.array([r[3] == "1" for r in rows], dtype=bool),
        errors=[r[4] for r in rows if r[3] != "1"],
    )
    if any(len(r) == STREAM_COLUMNS for r in rows):
        streamed = [r if len(r) == STREAM_COLUMNS else r + ["", "", ""] for r in rows]
        samples.ttft_ms = np.array([float(r[5] or "nan") for r in streamed])
        samples.output_tokens = np.array([float(r[6] or "nan") for r in streamed])
        samples.itl_ms = [np.array(r[7].split(), dtype=float) for r in streamed]
    return samples


def nearest_rank(sorted_values: np.ndarray, percentile: float) -> float:
    """The value at rank ceil(p% * n), as HDR histograms report: a latency that was observed,
    never an interpolation. (The 1e-9 absorbs float error such as 99.9 / 100 * 1000 = 999.0000000000001.)"""
    n = len(sorted_values)
    rank = min(n, max(1, math.ceil(percentile / 100 * n - 1e-9)))
    return float(sorted_values[rank - 1])


def _ranks(values: np.ndarray, percentiles=STREAM_PERCENTILES) -> dict[str, float]:
    ordered = np.sort(values)
    return {f"p{p:g}": nearest_rank(ordered, p) for p in percentiles} if len(ordered) else {}


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
    streaming: dict = field(default_factory=dict)  # see _streaming; empty for runs that did not stream

    def to_dict(self) -> dict:
        return asdict(self)


def _measured(samples: Samples, warmup_s: float) -> np.ndarray:
    """Requests that started after the warm-up."""
    return samples.start >= samples.start.min() + warmup_s


def _pooled_gaps(samples: Samples, use: np.ndarray) -> np.ndarray:
    """Every inter-token gap of the requests in `use`, in one array."""
    gaps = [samples.itl_ms[i] for i in np.flatnonzero(use)]
    return np.concatenate(gaps) if gaps else np.array([])


def _streaming(samples: Samples, use: np.ndarray, duration_s: float) -> dict:
    """TTFT, ITL (every gap), TPOT and output tokens/s of the requests in `use` (measured and successful).

    TPOT is (latency - TTFT) / (tokens - 1), so only requests of 2+ tokens with a first token have one;
    the aggregate output tokens/s is all their output tokens over the measured window.
    """
    lat = samples.latency_ms[use]
    ttft = samples.ttft_ms[use]
    tokens = samples.output_tokens[use]
    timed = np.isfinite(ttft)
    decoding = timed & (tokens > 1)
    return {
        "requests": int(use.sum()),
        "ttft_ms": _ranks(ttft[timed]),
        "itl_ms": _ranks(_pooled_gaps(samples, use)),
        "tpot_ms": _ranks((lat[decoding] - ttft[decoding]) / (tokens[decoding] - 1)),
        "output_tokens_per_s_per_request": _ranks(tokens / (lat / 1000.0)),
        "output_tokens_per_s": float(tokens.sum() / duration_s) if duration_s > 0 else 0.0,
        "mean_output_tokens": float(tokens.mean()),
    }


def summarize(samples: Samples, warmup_s: float = 0.0, settings: dict | None = None) -> Summary:
    """Figures over the window after `warmup_s`; percentiles from the sorted raw latencies."""
    if len(samples.end) == 0:
        return Summary(0, 0, 0.0, 0.0, {}, warmup_s, {}, settings or {})
    t0 = samples.start.min() + warmup_s
    keep = _measured(samples, warmup_s)
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
    streamed = keep & samples.ok & samples.streamed
    return Summary(
        requests=int(keep.sum()),
        errors=int((~ok).sum()),
        duration_s=duration,
        qps=float(ok.sum() / duration) if duration > 0 else 0.0,
        latency_ms=figures,
        warmup_s=warmup_s,
        error_kinds=dict(Counter(e.split(":")[0] or "unknown" for e in kept_errors).most_common(10)),
        settings=settings or {},
        streaming=_streaming(samples, streamed, duration) if streamed.any() else {},
    )


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
    _time_axis(ax_t, summary, "latency (ms)", "latency over time")
    if len(samples.end):
        lat = samples.latency_ms[ok & _measured(samples, summary.warmup_s)]
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
    measured = use & _measured(samples, summary.warmup_s)
    for ax, values, name, what in (
        (ax_f, samples.ttft_ms[measured], "ttft_ms", "time to first token"),
        (ax_i, _pooled_gaps(samples, measured), "itl_ms", "inter-token gap"),
    ):
        marks = summary.streaming.get(name, {})
        if len(values):
            _distribution(ax, values, marks, "ms", 1.5 * marks.get("p99", values.max()))
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("requests" if name == "ttft_ms" else "gaps")
        ax.set_title(f"{what} distribution (after warm-up)")
    return save(fig, path, title)


def headline(summary: Summary) -> str:
    lat = summary.latency_ms
    if not lat:
        return f"no successful request ({summary.requests} requests, {summary.errors} errors)"
    line = (f"P50 {lat['p50']:.1f} ms, P90 {lat['p90']:.1f} ms, P99 {lat['p99']:.1f} ms, "
              f"QPS {summary.qps:.1f}, errors {summary.errors}/{summary.requests}")
    ttft = summary.streaming.get("ttft_ms")
    if ttft:
        line += (f"; TTFT P50 {ttft['p50']:.1f} ms, P99 {ttft['p99']:.1f} ms, "
                 f"{summary.streaming['output_tokens_per_s']:.1f} output tokens/s")
    return line


def _streaming_section(streaming: dict) -> str:
    rows = "\n".join(
        f"| {label} | " + " | ".join(f"{streaming[key][f'p{p:g}']:.2f}" if streaming[key] else "–"
                                      for p in STREAM_PERCENTILES) + " |"
        for key, label in (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token gap (ms)"),
                           ("tpot_ms", "time per output token (ms)"),
                           ("output_tokens_per_s_per_request", "output tokens/s per request (P99: the fastest)"))
    )
    heads = " | ".join(f"P{p:g}" for p in STREAM_PERCENTILES)
    return f"""
## Streaming

![TTFT over time, TTFT and inter-token gap distributions](streaming.png)

Over the {streaming['requests']} successful streamed requests after warm-up. TTFT runs from sending the
request to the first chunk with text; inter-token gaps are between successive text chunks, all gaps
pooled; time per output token is (latency - TTFT) / (output tokens - 1), per request of 2+ tokens.

| streaming | {heads} |
|---|{'---|' * len(STREAM_PERCENTILES)}
{rows}

Output tokens/s over the measured window (all requests together): **{streaming['output_tokens_per_s']:.1f}**;
mean output tokens per request: {streaming['mean_output_tokens']:.1f}.
"""


def write_report(summary: Summary, samples: Samples, out_dir: Path, title: str) -> Path:
    """Write report.json, latency.png (and streaming.png for streamed runs) and report.md into `out_dir`;
    returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(summary.to_dict(), indent=2))
    plot(samples, summary, out_dir / "latency.png", title)
    streaming = ""
    if summary.streaming:
        plot_streaming(samples, summary, out_dir / "streaming.png", title)
        streaming = _streaming_section(summary.streaming)
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
{streaming}
| setting | value |
|---|---|
{settings}

Errors by kind:
{errors}
"""
    path = out_dir / "report.md"
    path.write_text(md)
    return path

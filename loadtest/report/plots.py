"""The run's plots: latency over time beside its distribution, streaming figures (TTFT, inter-token gaps), and
the servers' own figures under the client's latency."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from .report import Samples, Summary, measured, pooled_gaps
from ..server_metrics import Series


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


def latency_cdf(ax, lines: list[tuple[str, np.ndarray, str]]) -> None:
    """Cumulative fraction of requests against latency (log scale), one line per (label, latencies in ms, colour),
    with the P99 level marked: how whole distributions compare, tails included."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    for label, values, colour in lines:
        values = np.sort(np.asarray(values, dtype=float))
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), color=colour, label=label)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 5, 10, 20, 50, ...: labels that do not collide
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.99, color="grey", lw=0.8, ls="--")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)


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


def per_second(samples: Samples, t0: float | None = None) -> dict[str, np.ndarray]:
    """Per-second P50 / P99 latency and QPS of the successful requests, by start time since `t0` (default: the
    first request's start)."""
    t = samples.start - (samples.start.min() if t0 is None else t0)
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


def plot(samples: Samples, summary: Summary, path: Path, title: str, swaps: list | None = None) -> Path:
    """Latency over time (each request, with per-second P50/P99 and QPS) beside the latency distribution; a mix
    of APIs gets a row of its own per API, each on its own scale, and so does each model behind an alias. On-demand
    models' loads and unloads (`swaps`: server_metrics.swap_events) are marked on the time axes, each in its model's
    row where rows are per model."""
    plt = pyplot()
    # the APIs the summary has figures for (a mix's, after warm-up), else the models that answered: a row each
    rows = [(api, samples.where(samples.names == api), f["latency_ms"]) for api, f in summary.by_name.items()] \
        or [(f"model {m}", samples.where(samples.models == m), f["latency_ms"]) for m, f in summary.by_model.items()] \
        or [("", samples, summary.latency_ms)]
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 4.8 * len(rows)), squeeze=False)
    t0 = samples.start.min() if len(samples.end) else 0.0
    for (api, mine, marks), (ax_t, ax_d) in zip(rows, axes):
        _latency_row(ax_t, ax_d, mine, marks, summary, t0, f"{api}: " if api else "")
        shown = set(mine.models) if api else None  # a row's own models' swaps (a model row's, an API row's)
        mark_swaps(ax_t, [s for s in swaps or () if shown is None or s.model in shown])
    if (len(rows) > 1 or swaps) and len(samples.end):  # one time axis for every API, the swaps on it: rows line up
        end = max([float(samples.start.max() - t0), *(s.t for s in swaps or ())])
        for ax_t in axes[:, 0]:
            ax_t.set_xlim(0, end * 1.02 or 1.0)
    return save(fig, path, title)


MAX_SWAP_NAMES = 12  # more lines than this in one row: lines only, the counts are in the report's tables
SWAP_STYLE = {"load": dict(color="tab:purple", linestyle="--"), "unload": dict(color="tab:brown", linestyle=":")}


def mark_swaps(ax, swaps: list) -> None:
    """A vertical line at each load (dashed) and unload (dotted) of an on-demand model, named at the top where there
    are few enough to read."""
    for i, swap in enumerate(swaps):
        style = SWAP_STYLE[swap.what] | ({"color": "tab:red"} if swap.outcome == "failed" else {})
        ax.axvline(swap.t, linewidth=1, alpha=0.7, **style)
        if len(swaps) <= MAX_SWAP_NAMES:
            ax.annotate(f"{swap.what} {swap.model}", (swap.t, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=6, va="top", ha="right", color=style["color"], xytext=(-1, -2 - 30 * (i % 3)),
                        textcoords="offset points", annotation_clip=True)
    for what, style in SWAP_STYLE.items() if swaps else ():
        ax.plot([], [], linewidth=1, label=f"model {what}" + (f"s ({sum(s.what == what for s in swaps)})"
                                                                if len(swaps) > MAX_SWAP_NAMES else ""), **style)
    if swaps:
        ax.legend(loc="upper left", fontsize=7)


def _latency_row(ax_t, ax_d, samples: Samples, marks: dict, summary: Summary, t0: float, label: str) -> None:
    t = samples.start - t0
    ok = samples.ok
    ax_t.scatter(t[ok], samples.latency_ms[ok], s=3, alpha=0.25, color="tab:blue", label="request")
    if (~ok).any():
        ax_t.scatter(t[~ok], samples.latency_ms[~ok], s=8, color="tab:red", marker="x", label="error")
    if len(t):
        client = per_second(samples, t0)
        ax_t.plot(client["t"], client["p50"], color="tab:green", label="P50 per second")
        ax_t.plot(client["t"], client["p99"], color="tab:orange", label="P99 per second")
        ax_q = ax_t.twinx()
        ax_q.plot(client["t"], client["qps"], color="gray", linestyle=":", label="QPS")
        ax_q.set_ylabel("requests / s (dotted)")
        ax_q.set_ylim(bottom=0)
    _time_axis(ax_t, summary, "latency (ms)", f"{label}latency over time")
    if len(samples.end):
        lat = samples.latency_ms[ok & (samples.start >= t0 + summary.warmup_s)]
        if len(lat):
            _distribution(ax_d, lat, marks, "ms", 1.5 * marks.get("p99.9", lat.max()))
    ax_d.set_xlabel("latency (ms)")
    ax_d.set_ylabel("requests")
    ax_d.set_title(f"{label}latency distribution (after warm-up)")


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


PANELS = {  # panel -> (left axis, right axis), top to bottom
    "time": ("where time goes\nms per request", ""), "throughput": ("per second", "vLLM tokens/s (dashed)"),
    "triton": ("Triton ms per request", "batch size (dotted)"), "queues": ("requests", ""),
    "kv": ("caches %: vLLM KV,\nprefix hits, answer hits", ""), "gpu": ("GPU utilization %", "GPU memory GiB (dashed)"),
}


def panel_lines(series: dict[str, Series], client: dict) -> dict[str, list[tuple]]:
    """(x, y, label, style[, on the right axis]) per panel. Triton shows only its busiest models."""
    of = lambda role, only=None: [(n, s) for n, s in series.items()  # noqa: E731
                                  if s.role == role and (only is None or s.subject in only)]
    busy = {s.subject: np.nansum(s.y) for _, s in of("rps")}
    # Where the time goes: rank the models by the time requests spend in them (queue + compute), summed over
    # the run. An ensemble's own figures repeat its steps', so the steps (NAME_tokenizer, NAME_model, ... as
    # export names them) are what is ranked.
    spent = defaultdict(float)
    for _, s in of("queue") + of("compute"):
        spent[s.subject] += float(np.nansum(s.y * (s.w if s.w is not None else 1.0)))
    ensembles = {m for m in spent if any(other.startswith(f"{m}_") for other in spent)}
    working = sorted((m for m in spent if spent[m] > 0 and m not in ensembles), key=lambda m: -spent[m])
    out, dots, t = defaultdict(list), {"marker": ".", "markersize": 3, "lw": 1.1}, np.asarray(client.get("t", []))
    for key, label, color in (("p50", "client P50", "black"), ("p99", "client P99", "tab:red"),
                              ("qps", "client QPS", "black")):
        if len(client.get(key, [])) == len(t) > 0:
            out["throughput" if key == "qps" else "time"].append((t, client[key], label, {"color": color, "lw": 1.8}))
    top = sorted(busy, key=lambda m: -busy[m])[:3]
    for panel, roles, only in (("time", ("gateway", "overhead", "backend", "vllm_queue"), None),
                               ("time", ("queue", "compute"), working[:1]), ("throughput", ("rps",), top),
                               ("throughput", ("failures", "shed"), None), ("kv", ("kv", "prefix_hits", "answer_hits"), None),
                               ("queues", ("in flight", "queued", "running", "waiting"), None)):
        out[panel] += [(s.x, s.y, n, dots) for role in roles for n, s in of(role, only)
                       if role != "failures" or np.nanmax(s.y) > 0]  # a line of zeros says nothing
    out["throughput"] += [(s.x, s.y, n, {**dots, "color": "tab:gray", "ls": "--"}, True) for n, s in of("tokens")]
    for i, model in enumerate(working[:3]):  # one colour per model: queue dashed, compute solid, batch dotted
        for role, ls in (("queue", "--"), ("compute", "-"), ("batch", ":")):
            out["triton"] += [(s.x, s.y, n, {**dots, "color": f"C{i}", "ls": ls}, role == "batch")
                              for n, s in of(role, [model])]
    for role, ls in (("util", "-"), ("memory", "--")):
        out["gpu"] += [(s.x, s.y, n, {**dots, "color": f"C{i}", "ls": ls}, ls == "--")
                       for i, (n, s) in enumerate(of(role))]
    return out


def plot_servers(series: dict[str, Series], client: dict, path: Path, title: str, warmup_s: float = 0.0) -> Path | None:
    """Server series under the client's latency, one panel per group with data, on one time axis.

    Args:
        series: From `server_metrics.derive`.
        client: ``{"t": seconds since t0 (per-second bins), "p50": ms, "p99": ms, "qps": requests/s}``.
        path: The PNG to write.
        title: The figure's title.
        warmup_s: The warm-up, shaded grey.

    Returns:
        `path`, or None when there was nothing to draw.
    """
    lines = panel_lines(series, client)
    panels = [p for p in PANELS if lines.get(p)]
    if not panels:
        return None
    fig, axes = pyplot().subplots(len(panels), 1, figsize=(13, 2.6 * len(panels) + 0.9), sharex=True, squeeze=False)
    for i, (ax, panel) in enumerate(zip(axes[:, 0], panels)):
        twin = ax.twinx() if any(line[4:] for line in lines[panel]) else None
        for x, y, label, style, *right in lines[panel]:
            (twin if right and right[0] else ax).plot(x, y, label=label, **style)
        if warmup_s > 0:
            ax.axvspan(0, warmup_s, color="0.9", zorder=0, label="_" if i else "warm-up")
        handles, labels = ax.get_legend_handles_labels()
        for axis, label in ((ax, PANELS[panel][0]), (twin, PANELS[panel][1])):
            if axis is not None:
                axis.set_ylabel(label, fontsize=9)
                axis.set_ylim(bottom=0)
        if twin is not None:
            more = twin.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.grid(alpha=0.3)
        # Outside the axes, past the right-hand axis where there is one, so that no legend hides data.
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.07 if twin else 1.01, 1), fontsize=8,
                  frameon=False)
    axes[-1, 0].set_xlabel("seconds since the load test's start")
    axes[-1, 0].set_xlim(left=0)
    return save(fig, Path(path), title)

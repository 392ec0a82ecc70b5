"""A replay beside its trace (`rtxserve loadtest replay`): the arrivals, sizes, latency and cache hits recorded and
replayed, for the report's "Recorded vs replayed" section and its plot. The trace itself is read by
loadtest/scenarios/replayer.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from ..scenarios.replayer import GENERATION, Request, Trace


def _ideal_prefix_hits(requests: list[Request]) -> float | None:
    """The share of the trace's prefix blocks that an earlier request already sent (what a prefix cache large enough
    for all of them would hit), as `aiperf analyze-trace` reports it; None without hash ids."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        hits += sum(block in seen for block in r.hash_ids)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    return hits / total if total else None


def _repeats(requests: list[Request]) -> float | None:
    """The share of the encoder requests whose inputs an earlier one had sent (what a response cache can answer);
    None where no input hashes were recorded."""
    hashes = [r.input_hash for r in requests if r.input_hash is not None]
    return 1 - len(set(hashes)) / len(hashes) if hashes else None


def _side(at: np.ndarray, inputs: np.ndarray, outputs: np.ndarray, latency: np.ndarray, ttft: np.ndarray,
          apis: list[str], errors: int) -> dict:
    from .report import _ranks

    figures = {"requests": len(at), "errors": errors, "span_s": float(at.max() - at.min()) if len(at) else 0.0,
               "per_api": dict(Counter(apis))}
    figures["rate_rps"] = len(at) / figures["span_s"] if figures["span_s"] > 0 else None
    for name, values, percentiles in (("input_tokens", inputs, (50, 90)), ("output_tokens", outputs, (50, 90)),
                                      ("latency_ms", latency, (50, 99)), ("ttft_ms", ttft, (50, 99))):
        values = values[np.isfinite(values)]
        figures[name] = _ranks(values, percentiles) | {"mean": float(values.mean())} if len(values) else {}
    return figures


def compare(trace: Trace, samples, server: dict | None = None) -> dict:
    """Recorded vs replayed: arrivals (per time bin, and their correlation), the requests' sizes, their latency, and
    the cache hit rates the servers reported (`server`: server_metrics.summary's, where scraped)."""
    rs = trace.requests
    gen = [r.api in GENERATION for r in rs]
    nan = float("nan")
    recorded = _side(np.array([r.at for r in rs]),
                     np.array([r.input_tokens if g else nan for r, g in zip(rs, gen)], dtype=float),
                     np.array([r.output_tokens if g else nan for r, g in zip(rs, gen)], dtype=float),
                     np.array([r.recorded.get("latency_ms", nan) for r in rs], dtype=float),
                     np.array([r.recorded.get("ttft_ms", nan) for r in rs], dtype=float),
                     [r.api for r in rs], sum(r.recorded.get("status", 200) != 200 for r in rs))
    start = np.asarray(samples.start)
    none = np.full(len(start), nan)
    ok = np.asarray(samples.ok)
    replayed = _side(start, np.where(ok, samples.prompt_tokens if samples.prompt_tokens is not None else none, nan),
                     np.where(ok, samples.output_tokens if samples.output_tokens is not None else none, nan),
                     np.where(ok, samples.latency_ms, nan),
                     np.where(ok, samples.ttft_ms if samples.ttft_ms is not None else none, nan),
                     list(samples.names) if samples.names is not None else [], int((~ok).sum()))
    recorded_at, replayed_at = np.array([r.at for r in rs]), start - start.min()
    span = max(float(recorded_at.max()), float(replayed_at.max()), 1e-3)
    width = 1.0 if span >= 30 else span / 30  # at least 30 bins
    edges = np.arange(0.0, span + width, width)
    a, b = np.histogram(recorded_at, edges)[0], np.histogram(replayed_at, edges)[0]
    correlation = float(np.corrcoef(a, b)[0, 1]) if len(a) > 2 and a.std() > 0 and b.std() > 0 else None
    hits = {name: round(f["mean"], 2) for name, f in (server or {}).items()
            if ("prefix cache hits" in name or name.endswith("cache hits")) and np.isfinite(f["mean"])}
    q = np.linspace(0, 100, 101)
    sizes = {label: np.percentile(v, q, method="inverted_cdf").tolist()
             for label, v in (("prompt tokens", [r.input_tokens for r, g in zip(rs, gen) if g]),
                              ("output tokens", [r.output_tokens for r, g in zip(rs, gen) if g])) if v}
    return {"format": trace.format, "block_tokens": trace.block_tokens, "recorded_sizes": sizes,
            "skipped": dict(trace.skipped), "fitted": dict(trace.fitted), "recorded": recorded, "replayed": replayed,
            "arrivals": {"bin_s": width, "recorded": a.tolist(), "replayed": b.tolist(), "correlation": correlation},
            "ideal_prefix_hit_rate": _ideal_prefix_hits(rs), "repeat_share": _repeats(rs), "cache_hit_rate_pct": hits}


def section(figures: dict, png: str = "replay.png") -> str:
    """The report's "recorded vs replayed" section (Markdown)."""
    rec, rep = figures["recorded"], figures["replayed"]

    def cell(side: dict, key: str, sub: str | None = None) -> str:
        value = side.get(key) if sub is None else (side.get(key) or {}).get(sub)
        return "–" if value is None else f"{value:,.1f}" if isinstance(value, float) else f"{value:,}"

    rows = [("requests", "requests", None), ("failed", "errors", None), ("span (s)", "span_s", None),
            ("mean rate (req/s)", "rate_rps", None)]
    rows += [(f"{label} {p.upper() if p[1:].isdigit() else p}", key, p) for key, label, ps in (
        ("input_tokens", "prompt tokens", ("p50", "p90", "mean")), ("output_tokens", "output tokens", ("p50", "p90")),
        ("latency_ms", "latency ms", ("p50", "p99")), ("ttft_ms", "TTFT ms", ("p50", "p99"))) for p in ps]
    table = "\n".join(f"| {label} | {cell(rec, key, sub)} | {cell(rep, key, sub)} |" for label, key, sub in rows)
    apis = sorted(set(rec["per_api"]) | set(rep["per_api"]))
    table += "\n" + "\n".join(f"| {api} requests | {rec['per_api'].get(api, 0):,} | {rep['per_api'].get(api, 0):,} |"
                              for api in apis)
    arrivals = figures["arrivals"]
    corr = "–" if arrivals["correlation"] is None else f"{arrivals['correlation']:.2f}"
    ideal = figures["ideal_prefix_hit_rate"]
    lines = [f"Arrivals per {arrivals['bin_s']:.2g} s, recorded vs replayed: correlation **{corr}**."]
    if ideal is not None:
        lines.append(f"Prefix blocks an earlier request already sent: {ideal:.0%} of the trace's ({figures['block_tokens']} "
                     "tokens a block): what a cache that kept them all would hit.")
    if figures.get("repeat_share") is not None:
        lines.append(f"Encoder requests that repeat an earlier one's inputs: {figures['repeat_share']:.0%} (replayed as "
                     "the same inputs: what a response cache can answer).")
    for name, rate in figures["cache_hit_rate_pct"].items():
        lines.append(f"{name} during the replay: {rate:.1f} %.")
    for model, c in (figures.get("capacity") or {}).items():
        lines.append(f"{model}: replayed at {c['replayed_rps']:g} requests/s, {c['share']:.0%} of the box's confirmed "
                     f"capacity ({c['capacity_rps']:g} requests/s, `rtxserve capacity --record`)"
                     + (", STALE: measured before the box changed" if c["stale"] else "") + ".")
    if figures.get("fitted"):
        lines.append("Fitted to the box (the recorded column is the trace as fitted): " + ", ".join(
            f"{n} {why}" for why, n in figures["fitted"].items()) + ".")
    if figures["skipped"]:
        lines.append("Not replayed: " + ", ".join(f"{n} {why}" for why, n in figures["skipped"].items()) + ".")
    notes = "\n".join(f"- {line}" for line in lines)
    return f"""
## Recorded vs replayed

![arrivals and sizes, recorded vs replayed]({png})

| figure | recorded | replayed |
|---|---|---|
{table}

{notes}
"""


def plot(figures: dict, samples, path: Path, title: str) -> Path:
    """Arrivals per time bin (recorded and replayed, one axis) and the prompt and output lengths as quantiles."""
    from .plots import pyplot, save

    plt = pyplot()
    arrivals = figures["arrivals"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [1.2, 1]})
    x = np.arange(len(arrivals["recorded"])) * arrivals["bin_s"]
    top.step(x, np.array(arrivals["recorded"]) / arrivals["bin_s"], where="post", color="black", lw=1.6, label="recorded")
    top.step(x, np.array(arrivals["replayed"]) / arrivals["bin_s"], where="post", color="tab:red", lw=1.1, label="replayed")
    top.set(xlabel="seconds after the first request", ylabel="arrivals per second",
            title=f"arrivals (correlation {arrivals['correlation']:.2f})" if arrivals["correlation"] is not None
            else "arrivals")
    top.legend(loc="upper right")
    ok = np.asarray(samples.ok)
    q = np.linspace(0, 100, 101)
    for (label, rep), style in zip((("prompt tokens", samples.prompt_tokens), ("output tokens", samples.output_tokens)),
                                   ("-", "--")):
        rep = np.asarray(rep, dtype=float)[ok] if rep is not None else np.array([])
        rep = rep[np.isfinite(rep)]
        if label in figures["recorded_sizes"]:
            bottom.plot(q, figures["recorded_sizes"][label], color="black", ls=style, label=f"{label}, recorded")
        if len(rep):
            bottom.plot(q, np.percentile(rep, q, method="inverted_cdf"), color="tab:red", ls=style, label=f"{label}, replayed")
    bottom.set(xlabel="percentile", ylabel="tokens", title="request sizes (generation)")
    if bottom.lines:
        bottom.legend(loc="upper left")
    else:
        bottom.text(0.5, 0.5, "no generation requests", ha="center", va="center", transform=bottom.transAxes)
    return save(fig, path, title)

"""Turn raw per-request samples into figures: P50/P90/P99/P99.9, QPS, errors, goodput under an SLO, figures
per API of a mix, late open-loop arrivals. Streamed runs (rows that carry time to first token, inter-token
gaps and output tokens) also get TTFT / ITL / TPOT / output tokens/s. (plots.py draws them, pages.py writes
the report.)
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99, 99.9)
STREAM_PERCENTILES = (50, 90, 99)


@dataclass
class Samples:
    end: np.ndarray  # epoch seconds
    latency_ms: np.ndarray
    ok: np.ndarray  # bool
    errors: list[str]
    # Streaming figures, NaN / empty where a request has none (not streamed, failed, or no text).
    ttft_ms: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    prompt_tokens: np.ndarray | None = None
    itl_ms: list[np.ndarray] | None = None
    names: np.ndarray | None = None  # the API of each request (classify, chat, ...)
    wait_ms: np.ndarray | None = None  # open loop: how late each request left after its arrival time
    cap_wait_ms: np.ndarray | None = None  # open loop: of that, how long it waited for the in-flight cap
    images: np.ndarray | None = None  # image generation and detection: images per request (NaN for other APIs)
    detections: np.ndarray | None = None  # detection: objects found per request (NaN for other APIs)
    audio_s: np.ndarray | None = None  # speech: seconds of audio per request (NaN for other APIs)
    models: np.ndarray | None = None  # the model each answer names ("" if none): behind an alias, the target
    turns: np.ndarray | None = None  # multi-turn chat: each request's turn in its conversation, from 1 (NaN: none)

    @property
    def start(self) -> np.ndarray:
        return self.end - self.latency_ms / 1000.0

    def where(self, mask: np.ndarray) -> "Samples":
        """The requests `mask` selects (e.g. one API of a mix), every column cut alike."""
        cut = lambda a: None if a is None else a[mask]  # noqa: E731
        return Samples(end=self.end[mask], latency_ms=self.latency_ms[mask], ok=self.ok[mask],
                       errors=[e for e, k in zip(self.errors, mask[~self.ok]) if k], ttft_ms=cut(self.ttft_ms),
                       output_tokens=cut(self.output_tokens), prompt_tokens=cut(self.prompt_tokens),
                       itl_ms=None if self.itl_ms is None else [g for g, k in zip(self.itl_ms, mask) if k],
                       names=cut(self.names), wait_ms=cut(self.wait_ms), cap_wait_ms=cut(self.cap_wait_ms), images=cut(self.images),
                       detections=cut(self.detections), audio_s=cut(self.audio_s), models=cut(self.models),
                       turns=cut(self.turns))

    @property
    def streamed(self) -> np.ndarray:
        """Which requests were streamed answers (they have a time to first token)."""
        if self.ttft_ms is None:
            return np.zeros(len(self.end), dtype=bool)
        return np.isfinite(self.ttft_ms)


def _floats(rows: list[dict], column: str) -> np.ndarray:
    return np.array([float(r.get(column) or "nan") for r in rows])


def load_samples(path: str | Path) -> Samples:
    """Read the raw-sample CSV a run wrote (see loadtest/scenarios/samples.py for its columns)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("ok") in ("0", "1")]  # a row cut short at a kill has no ok
    rows.sort(key=lambda r: float(r["end"]))
    ok = np.array([r["ok"] == "1" for r in rows], dtype=bool)
    samples = Samples(
        end=_floats(rows, "end"), latency_ms=_floats(rows, "latency_ms"), ok=ok,
        errors=[r["error"] for r in rows if r["ok"] != "1"],
        names=np.array([r["name"] for r in rows], dtype=object), wait_ms=_floats(rows, "wait_ms"),
        cap_wait_ms=_floats(rows, "cap_wait_ms"),
        models=np.array([r.get("model") or "" for r in rows], dtype=object),
    )
    for field_name, column in (("images", "images"), ("detections", "detections"), ("audio_s", "audio_s"),
                               ("turns", "turn")):  # columns of some APIs only: kept where any request has one
        values = _floats(rows, column)
        if np.isfinite(values).any():
            setattr(samples, field_name, values)
    tokens = _floats(rows, "output_tokens")
    if np.isfinite(tokens).any():
        samples.ttft_ms = _floats(rows, "ttft_ms")
        samples.output_tokens = tokens
        samples.prompt_tokens = _floats(rows, "prompt_tokens")
        samples.itl_ms = [np.array((r.get("itl_ms") or "").split(), dtype=float) for r in rows]
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
    sent_rps: float  # requests sent per second in the window (from their start times): the load actually offered
    latency_ms: dict[str, float]  # p50/p90/p99/p99.9/mean/max of successful requests
    warmup_s: float
    error_kinds: dict[str, int] = field(default_factory=dict)
    # per kind and API ("HTTP 400 chat"): the first distinct reasons the server gave, with how often each came
    error_reasons: dict[str, list] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    streaming: dict = field(default_factory=dict)  # see _streaming; empty for runs that did not stream
    goodput: dict = field(default_factory=dict)  # see _goodput; empty without an SLO
    by_name: dict = field(default_factory=dict)  # per API of a mixed run: requests, errors, qps, latency
    by_model: dict = field(default_factory=dict)  # the same per model that answered, where more than one did (an alias)
    late_arrivals: dict = field(default_factory=dict)  # open loop: requests that left late (load generator or cap)
    replay: dict = field(default_factory=dict)  # a replayed trace: recorded vs replayed (replayed.py's compare)
    images: dict = field(default_factory=dict)  # image generation: images/s and per-image latency; see _images
    speech: dict = field(default_factory=dict)  # speech to text: audio seconds per second; see _speech

    def to_dict(self) -> dict:
        return asdict(self)


def _reasons(errors: list[str], names, most: int = 3) -> dict[str, list]:
    """Per kind and API, the first `most` distinct reasons (`HTTP 400: reason`) and how often each came."""
    counts: dict[str, Counter] = {}
    for i, error in enumerate(errors):
        kind, _, why = error.partition(":")
        key = f"{kind or 'unknown'} {names[i]}" if names is not None and i < len(names) else kind or "unknown"
        counts.setdefault(key, Counter())[why.strip() or "(no reason given)"] += 1
    return {key: [[why, n] for why, n in list(found.items())[:most]] for key, found in counts.items()}


def measured(samples: Samples, warmup_s: float) -> np.ndarray:
    """Requests that started after the warm-up."""
    return samples.start >= samples.start.min() + warmup_s


def pooled_gaps(samples: Samples, use: np.ndarray) -> np.ndarray:
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
        "itl_ms": _ranks(pooled_gaps(samples, use)),
        "tpot_ms": _ranks((lat[decoding] - ttft[decoding]) / (tokens[decoding] - 1)),
        "output_tokens_per_s_per_request": _ranks(tokens / (lat / 1000.0)),
        "output_tokens_per_s": float(tokens.sum() / duration_s) if duration_s > 0 else 0.0,
        "mean_output_tokens": float(tokens.mean()),
    }


def _images(samples: Samples, use: np.ndarray, duration_s: float) -> dict:
    """Images per second over the measured window, and each request's latency divided by its images."""
    count = samples.images[use]
    figures = {"requests": int(use.sum()), "images": int(count.sum()),
               "images_per_s": float(count.sum() / duration_s) if duration_s > 0 else 0.0,
               "per_image_ms": _ranks(samples.latency_ms[use] / count)}
    if samples.detections is not None:  # a detector's: how many objects it found per image
        figures["detections_per_image"] = float(np.nansum(samples.detections[use]) / count.sum())
    return figures


RTF_PERCENTILES = (1, 10, 50)  # a real-time factor is better high: its slow tail is at the low percentiles


def _speech(samples: Samples, use: np.ndarray, duration_s: float) -> dict:
    """Real-time factor: seconds of audio transcribed per second of wall time, over the measured window (all
    requests together) and per request (its audio over its latency)."""
    audio = samples.audio_s[use]
    return {"requests": int(use.sum()), "audio_s": float(audio.sum()),
            "real_time_factor": float(audio.sum() / duration_s) if duration_s > 0 else 0.0,
            "per_request_rtf": _ranks(audio / (samples.latency_ms[use] / 1000.0), RTF_PERCENTILES)}


MAX_ERROR_FRACTION = 0.01  # a run with more failed requests does not hold its load, whatever its P99
LATE_MS = 10.0  # an open-loop request that left this much after its arrival time is counted as late


def per_request(samples: Samples) -> dict[str, np.ndarray]:
    """Each request's SLO figures in ms, NaN where a request has none (TTFT of an unstreamed request...)."""
    n = len(samples.end)
    figures = {"e2el": samples.latency_ms.astype(float)}
    if samples.ttft_ms is None:
        return figures | {k: np.full(n, np.nan) for k in ("ttft", "tpot", "itl")}
    tokens = samples.output_tokens
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(tokens > 1, (samples.latency_ms - samples.ttft_ms) / (tokens - 1), np.nan)
    itl = np.array([g.max() if len(g) else np.nan for g in samples.itl_ms])
    return figures | {"ttft": samples.ttft_ms, "tpot": tpot, "itl": itl}


def meets_slo(samples: Samples, slo: dict[str, float]) -> np.ndarray:
    """Successful requests within every limit; a limit applies to the requests that have its figure."""
    figures = per_request(samples)
    good = samples.ok.copy()
    for name, limit in slo.items():
        values = figures[name]
        good &= ~(values > limit)  # NaN compares False: no figure, no breach
    return good


def _goodput(samples: Samples, keep: np.ndarray, slo: dict[str, float], duration: float) -> dict:
    """Requests per second that met the SLO, and P99 of each SLO figure over the successful requests."""
    good = meets_slo(samples, slo) & keep
    figures = per_request(samples)
    ok = keep & samples.ok
    p99 = {name: (_ranks(figures[name][ok & np.isfinite(figures[name])], (99,)) or {}).get("p99") for name in slo}
    return {"slo_ms": slo, "good_requests": int(good.sum()), "goodput_rps": float(good.sum() / duration) if duration else 0.0,
            "fraction": float(good.sum() / max(1, keep.sum())), "p99_ms": p99,
            "p99_within_slo": all(v is not None and v <= slo[k] for k, v in p99.items())}


def _latency_figures(latency_ms: np.ndarray) -> dict[str, float]:
    lat = np.sort(latency_ms)
    if not len(lat):
        return {}
    figures = {f"p{p:g}": nearest_rank(lat, p) for p in PERCENTILES}
    return figures | {"mean": float(lat.mean()), "max": float(lat.max()), "min": float(lat.min())}


def summarize(samples: Samples, warmup_s: float = 0.0, settings: dict | None = None,
              slo: dict[str, float] | None = None) -> Summary:
    """Figures over the window after `warmup_s`; percentiles from the sorted raw latencies."""
    if len(samples.end) == 0:
        return Summary(0, 0, 0.0, 0.0, 0.0, {}, warmup_s, {}, settings or {})
    t0 = samples.start.min() + warmup_s
    keep = measured(samples, warmup_s)
    if not keep.any():
        raise ValueError(f"no request started after the {warmup_s}s warm-up; run longer or shorten --warmup")
    ok = samples.ok[keep]
    duration = float(samples.end[keep].max() - t0)
    kept_errors = [e for e, k in zip(samples.errors, keep[~samples.ok]) if k]
    streamed = keep & samples.ok & samples.streamed
    summary = Summary(
        requests=int(keep.sum()),
        errors=int((~ok).sum()),
        duration_s=duration,
        qps=float(ok.sum() / duration) if duration > 0 else 0.0,
        sent_rps=float(keep.sum() / sending) if (sending := float(samples.start[keep].max() - t0)) > 0 else 0.0,
        latency_ms=_latency_figures(samples.latency_ms[keep][ok]),
        warmup_s=warmup_s,
        error_kinds=dict(Counter(e.split(":")[0] or "unknown" for e in kept_errors).most_common(10)),
        error_reasons=_reasons(kept_errors, samples.names[keep & ~samples.ok] if samples.names is not None else None),
        settings=settings or {},
        streaming=_streaming(samples, streamed, duration) if streamed.any() else {},
    )
    if summary.streaming and samples.turns is not None and (samples.turns[streamed] > 1).any():
        # A conversation's later turns resend its history: what a prefix cache (and cache-aware routing) can save.
        for key, turns in (("ttft_ms_first_turns", samples.turns == 1), ("ttft_ms_later_turns", samples.turns > 1)):
            summary.streaming[key] = _ranks(samples.ttft_ms[streamed & turns])
    if slo:
        summary.goodput = _goodput(samples, keep, slo, duration)
    if samples.images is not None:
        made = keep & samples.ok & np.isfinite(samples.images)
        if made.any():
            summary.images = _images(samples, made, duration)
    if samples.audio_s is not None:
        heard = keep & samples.ok & np.isfinite(samples.audio_s)
        if heard.any():
            summary.speech = _speech(samples, heard, duration)
    summary.by_name = _split(samples, keep, samples.names, duration)
    # A failed request names no model: the split is over the answers, and their errors stay in the whole's figures.
    summary.by_model = _split(samples, keep & (samples.models != ""), samples.models, duration) \
        if samples.models is not None else {}
    if samples.wait_ms is not None and np.isfinite(samples.wait_ms[keep]).any():
        waits = samples.wait_ms[keep & np.isfinite(samples.wait_ms)]
        capped = samples.cap_wait_ms[keep & np.isfinite(samples.wait_ms)] if samples.cap_wait_ms is not None else waits * np.nan
        summary.late_arrivals = {"requests": int((waits > LATE_MS).sum()), "of": int(len(waits)),
                                 "max_wait_ms": float(waits.max()), "late_ms": LATE_MS,
                                 "capped": int((capped > LATE_MS).sum())}  # NaN (an older file): not counted
    return summary


def _split(samples: Samples, keep: np.ndarray, labels: np.ndarray | None, duration: float) -> dict:
    """Figures per label (an API of a mix, a model behind an alias) of the requests `keep` selects, where they hold
    more than one label; else nothing."""
    if labels is None or len(set(labels[keep])) < 2:
        return {}
    split = {}
    for label in sorted(set(labels[keep])):
        mine = keep & (labels == label)
        good = mine & samples.ok
        split[label] = {"requests": int(mine.sum()), "errors": int((mine & ~samples.ok).sum()),
                        "qps": float(good.sum() / duration) if duration > 0 else 0.0,
                        "latency_ms": _latency_figures(samples.latency_ms[good])}
        if (good & samples.streamed).any():
            split[label]["ttft_ms"] = _ranks(samples.ttft_ms[good & samples.streamed])
    return split


def _api_line(name: str, f: dict) -> str:
    lat = f["latency_ms"]
    if not lat:
        return f"{name}: no successful request ({f['requests']} requests, {f['errors']} errors)"
    line = (f"{name}: P50 {lat['p50']:.1f} ms, P99 {lat['p99']:.1f} ms, QPS {f['qps']:.1f}, "
            f"errors {f['errors']}/{f['requests']}")
    ttft = f.get("ttft_ms")
    return line + (f"; TTFT P50 {ttft['p50']:.1f} ms, P99 {ttft['p99']:.1f} ms" if ttft else "")


def headline(summary: Summary) -> str:
    """The run in a line; a mix of APIs in a line per API (a figure pooled over a 20 ms classify and a 1.3 s
    stream describes neither)."""
    if summary.by_name:
        return "\n".join(_api_line(name, f) for name, f in summary.by_name.items())
    if summary.by_model:
        return "\n".join(_api_line(f"model {name}", f) for name, f in summary.by_model.items())
    lat = summary.latency_ms
    if not lat:
        return f"no successful request ({summary.requests} requests, {summary.errors} errors)"
    line = (f"P50 {lat['p50']:.1f} ms, P90 {lat['p90']:.1f} ms, P99 {lat['p99']:.1f} ms, "
              f"QPS {summary.qps:.1f}, errors {summary.errors}/{summary.requests}")
    per_image = summary.images.get("per_image_ms")
    if per_image:
        line += f"; {summary.images['images_per_s']:.2f} images/s, per image P50 {per_image['p50']:.0f} ms, P99 {per_image['p99']:.0f} ms"
    if summary.speech:
        line += (f"; real-time factor {summary.speech['real_time_factor']:.1f} (audio s per s), per request P50 "
                 f"{summary.speech['per_request_rtf']['p50']:.1f}")
    ttft = summary.streaming.get("ttft_ms")
    if ttft:
        line += (f"; TTFT P50 {ttft['p50']:.1f} ms, P99 {ttft['p99']:.1f} ms, "
                 f"{summary.streaming['output_tokens_per_s']:.1f} output tokens/s")
    return line



"""The run's report: report.json, summary.csv, plots, report.md and the same page as self-contained HTML
(plots embedded, run metadata, the servers' side beside the client's)."""

from __future__ import annotations

import base64
import csv
import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np

from .plots import per_second, plot, plot_servers, plot_streaming
from .report import RTF_PERCENTILES, STREAM_PERCENTILES, Samples, Summary, headline


def _streaming_section(streaming: dict) -> str:
    rows = "\n".join(
        f"| {label} | " + " | ".join(f"{streaming[key][f'p{p:g}']:.2f}" if streaming[key] else "–"
                                      for p in STREAM_PERCENTILES) + " |"
        for key, label in (("ttft_ms", "time to first token (ms)"),
                           ("ttft_ms_first_turns", "TTFT of first turns (ms)"),
                           ("ttft_ms_later_turns", "TTFT of later turns: history resent (ms)"),
                           ("itl_ms", "inter-token gap (ms)"), ("tpot_ms", "time per output token (ms)"),
                           ("output_tokens_per_s_per_request", "output tokens/s per request (P99: the fastest)"))
        if key in streaming
    )
    heads = " | ".join(f"P{p:g}" for p in STREAM_PERCENTILES)
    return f"""
## Streaming

![TTFT over time, TTFT and inter-token gap distributions](streaming.png)

Over the {streaming['requests']} successful streamed requests after warm-up. TTFT runs from sending the
request to the first event with a token (as `vllm bench serve` times it); inter-token gaps are between
successive token events, all gaps pooled; time per output token is (latency - TTFT) / (output tokens - 1), per request of 2+ tokens.

| streaming | {heads} |
|---|{'---|' * len(STREAM_PERCENTILES)}
{rows}

Output tokens/s over the measured window (all requests together): **{streaming['output_tokens_per_s']:.1f}**;
mean output tokens per request: {streaming['mean_output_tokens']:.1f}.
"""


def _speech_section(speech: dict) -> str:
    heads = " | ".join(f"P{p:g}" for p in RTF_PERCENTILES)
    values = " | ".join(f"{speech['per_request_rtf'][f'p{p:g}']:.1f}" for p in RTF_PERCENTILES)
    return f"""
## Speech

{speech['audio_s']:.0f} s of audio in {speech['requests']} successful requests after warm-up: a real-time factor of
**{speech['real_time_factor']:.1f}** (seconds of audio transcribed per second, all requests together). Per request,
its audio's length over its latency (higher is faster, below 1 is slower than real time; P1 is the slowest 1 %):

| real-time factor | {heads} |
|---|{'---|' * len(RTF_PERCENTILES)}
| per request | {values} |
"""


def _images_section(images: dict) -> str:
    found = images.get("detections_per_image")
    detections = "" if found is None else f" The detector found **{found:.2f} objects per image** on average."
    heads = " | ".join(f"P{p:g}" for p in STREAM_PERCENTILES)
    values = " | ".join(f"{images['per_image_ms'][f'p{p:g}']:.0f}" for p in STREAM_PERCENTILES)
    return f"""
## Images

{images['images']} images in {images['requests']} successful requests after warm-up: **{images['images_per_s']:.2f}
images/s**. Per-image latency is each request's latency divided by the images it asked for.{detections}

| per image | {heads} |
|---|{'---|' * len(STREAM_PERCENTILES)}
| latency (ms) | {values} |
"""


def flat(data: dict) -> dict[str, float | int | str]:
    """Every figure of a summary (its dict, settings left out) as one level of keys (`latency_ms.p99`,
    `streaming.ttft_ms.p50`, ...)."""
    out = {}

    def walk(value, key):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value

    walk({k: v for k, v in data.items() if k != "settings"}, "")
    return out


def markdown_table(rows: list[list], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _goodput_section(goodput: dict) -> str:
    slo = ", ".join(f"{k} ≤ {v:g} ms" for k, v in goodput["slo_ms"].items())
    rows = [[k, f"{v:g}", "–" if goodput["p99_ms"][k] is None else f"{goodput['p99_ms'][k]:.1f}"]
            for k, v in goodput["slo_ms"].items()]
    verdict = "within" if goodput["p99_within_slo"] else "**not** within"
    return f"""
## Goodput

SLO: {slo}. **{goodput['goodput_rps']:.2f} requests/s** met every limit ({goodput['fraction']:.1%} of the requests;
a limit applies to the requests that have its figure). P99 is {verdict} the SLO.

{markdown_table(rows, ["figure", "limit (ms)", "P99 (ms)"])}
"""


def _split_section(split: dict, heading: str, label: str, note: str = "") -> str:
    rows = [[name, f["requests"], f["errors"], f"{f['qps']:.1f}",
             *(f"{f['latency_ms'].get(p, float('nan')):.1f}" for p in ("p50", "p90", "p99")),
             *(f"{f['ttft_ms'][p]:.1f}" if "ttft_ms" in f else "-" for p in ("p50", "p99"))]
            for name, f in split.items()]
    return f"\n## {heading}\n\n{note}" + markdown_table(rows, [label, "requests", "errors", "QPS", "P50 ms", "P90 ms", "P99 ms",
                                                      "TTFT P50 ms", "TTFT P99 ms"]) + "\n"


def _by_model_section(by_model: dict) -> str:
    return _split_section(by_model, "Per answering model", "model",
                          "The model each answer names: behind an alias, the target that answered (a failed request "
                          "names none and is counted in the whole run's errors only). `rtxserve loadtest compare RUN` "
                          "sets two of them side by side.\n\n")


def _warnings(summary: Summary) -> list[str]:
    notes = []
    load = summary.settings.get("load generator") or {}
    if load.get("cpu_bound"):
        notes.append(f"The load generator was CPU-bound (its busiest process used {load.get('busiest_process_cores')} "
                     "cores): the figures may describe locust rather than the server. Run with more --workers.")
    late = summary.late_arrivals
    if late and late["requests"]:
        capped = late.get("capped", 0)
        why = (f"{capped} waited for the in-flight cap (--max-in-flight), the others for the load generator, busy"
               if capped else "the load generator was busy (not the in-flight cap)")
        notes.append(f"{late['requests']} of {late['of']} requests left more than {late['late_ms']:g} ms after their "
                     f"arrival time (at most {late['max_wait_ms']:.0f} ms): {why}, so the load was not fully open.")
    return notes


def _server_section(out_dir: Path, samples: Samples, summary: Summary, title: str, errors: dict) -> str:
    """The servers' side of the run, from the /metrics scraped during it; empty when nothing was scraped."""
    from .. import server_metrics

    path = out_dir / "server_metrics.csv"
    failed = "".join(f"\n- {url}: {message}" for url, message in (errors or {}).items())
    failed = f"\nEndpoints that did not answer:{failed}\n" if failed else ""
    if not path.exists() or not len(samples.end):
        return failed
    t0 = float(samples.start.min())
    series = server_metrics.derive(server_metrics.load(path), t0)
    if not series:  # nothing scraped (or nothing answered): no section about the servers
        return failed
    png = plot_servers(series, per_second(samples), out_dir / "server.png", title, summary.warmup_s)
    if png is None:
        return failed
    figures = server_metrics.summary(series, summary.warmup_s)
    table = _server_tables(series, figures)
    return f"""{_split(figures)}
## Where the time goes: the servers' side

![client latency beside the gateway's, Triton's and vLLM's own figures](server.png)

Scraped from each server's Prometheus `/metrics` every second during the run, on the same time axis as
the client's latency: the gateway's own time vs its backend calls, Triton's queue vs compute time per
request and batch size, vLLM's running / waiting requests and KV-cache use. The tables give each figure's
mean after the warm-up (per-request means weighted by the requests of each second). For streamed answers the
gateway's backend call time ends when the stream opened, its request time when the stream ended.

{table}
{failed}"""


def _split(figures: dict) -> str:
    """The client's latency split into the gateway's own share (x-rtxserve-overhead-ms, as its histogram) and the
    rest (its backends, and the network), from the means after warm-up."""
    held, own = figures.get("gateway request time"), figures.get("gateway overhead")
    if not held or not own or not np.isfinite(held["mean"]) or not np.isfinite(own["mean"]) or held["mean"] <= 0:
        return ""
    share = own["mean"] / held["mean"]
    return (f"\n**The gateway's own share**: {own['mean']:.2f} ms of the {held['mean']:.2f} ms it held each request "
            f"({share:.0%}); the other {held['mean'] - own['mean']:.2f} ms were its backends' (streams: to the "
            "response's start only).\n")


TRITON_COLUMNS = (("rps", "requests/s"), ("queue", "queue ms"), ("compute", "compute ms"), ("batch", "batch size"),
                  ("failures", "failures/s"), ("cache", "cache hit %"))


def _server_tables(series: dict, figures: dict) -> str:
    """The servers' figures (means after warm-up): one row per Triton model, then everything else."""
    fmt = lambda f: "–" if f is None or not np.isfinite(f["mean"]) else f"{f['mean']:.2f}"  # noqa: E731
    triton: dict[str, dict] = {}
    others = []
    for name, s in series.items():
        if name.startswith("triton "):
            triton.setdefault(s.subject, {})[s.role] = figures[name]
        elif np.isfinite(figures[name]["mean"]):
            f = figures[name]
            others.append([name, f"{f['mean']:.2f}", f"{f['max']:.2f}", f["unit"]])
    text = ""
    if triton:
        rows = [[model, *(fmt(roles.get(role)) for role, _ in TRITON_COLUMNS)] for model, roles in sorted(triton.items())]
        text += markdown_table(rows, ["Triton model", *(label for _, label in TRITON_COLUMNS)]) + "\n\n"
    if others:
        text += markdown_table(others, ["figure", "mean", "max", "unit"]) + "\n"
    return text


def _git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent)
        return done.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("rtxserve", "locust", "numpy"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found | {"git commit": _git_commit()}


def _swaps(out_dir: Path, samples: Samples) -> list:
    """The on-demand models' loads and unloads the gateway counted during the run (none without a scrape)."""
    from .. import server_metrics

    path = out_dir / "server_metrics.csv"
    if not path.exists() or not len(samples.end):
        return []
    return server_metrics.swap_events(server_metrics.load(path), float(samples.start.min()))


def write_report(summary: Summary, samples: Samples, out_dir: Path, title: str, scrape_errors: dict | None = None) -> Path:
    """Write report.json, summary.csv, latency.png (streaming.png for streamed runs, server.png when servers
    were scraped), report.md and report.html into `out_dir`; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary.settings.setdefault("versions", versions())
    summary.settings.setdefault("created", time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    (out_dir / "report.json").write_text(json.dumps(summary.to_dict(), indent=2, default=str))
    with open(out_dir / "summary.csv", "w", newline="") as f:
        csv.writer(f).writerows([("figure", "value"), *flat(summary.to_dict()).items()])
    plot(samples, summary, out_dir / "latency.png", title, _swaps(out_dir, samples))
    streaming = ""
    if summary.streaming:
        plot_streaming(samples, summary, out_dir / "streaming.png", title)
        streaming = _streaming_section(summary.streaming)
    lat = summary.latency_ms
    rows = "\n".join(f"| {k.upper()} | {v:.2f} |" for k, v in lat.items())
    settings = "\n".join(f"| {k} | {_show(v)} |" for k, v in summary.settings.items())
    errors = "\n".join(f"- {k}: {v}" for k, v in summary.error_kinds.items()) or "- none"
    if summary.error_reasons:
        errors += "\n\nWhat the server said, by status and API (the first distinct reasons):\n\n" + "\n".join(
            f"- {key}: {why} ({n})" for key, found in summary.error_reasons.items() for why, n in found)
    warnings = "".join(f"\n> **Warning:** {w}\n" for w in _warnings(summary))
    bold_headline = "  \n".join(f"**{line}**" for line in headline(summary).splitlines())  # a line per API of a mix
    md = f"""# {title}

{bold_headline}
{warnings}
![latency over time and distribution](latency.png)

Measured window: {summary.duration_s:.1f} s after a {summary.warmup_s:g} s warm-up; {summary.requests} requests,
{summary.errors} errors. Percentiles are computed from every request's own latency (raw samples),
not from locust's rounded buckets. QPS counts successful requests.

| latency{" (pooled over all APIs: see per API below)" if summary.by_name else ""} | ms |
|---|---|
{rows}
{_replay_section(summary, samples, out_dir, title)}{_goodput_section(summary.goodput) if summary.goodput else ""}{_split_section(summary.by_name, "Per API", "API") if summary.by_name else ""}{_by_model_section(summary.by_model) if summary.by_model else ""}{streaming}{_images_section(summary.images) if summary.images else ""}{_speech_section(summary.speech) if summary.speech else ""}{_server_section(out_dir, samples, summary, title, scrape_errors)}
## Run

| setting | value |
|---|---|
{settings}

Errors by kind:

{errors}

Raw samples: `samples.csv`; every figure: `report.json`, `summary.csv`; the locust command: `command.txt`.
"""
    path = out_dir / "report.md"
    path.write_text(md)
    write_html(md, out_dir, title)
    return path


def _replay_section(summary: Summary, samples: Samples, out_dir: Path, title: str) -> str:
    if not summary.replay:
        return ""
    from . import replayed

    replayed.plot(summary.replay, samples, out_dir / "replay.png", title)
    return replayed.section(summary.replay)


def _show(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}blockquote{background:#fff4e5;margin:1em 0;
padding:.5em 1em;border-left:4px solid #f0a020}code{background:#f5f5f5;padding:0 .2em}"""


def write_html(markdown_text: str, out_dir: Path, title: str, name: str = "report.html") -> Path:
    """The Markdown page as one self-contained HTML file: its PNGs embedded as data URLs."""
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables"])

    def embed(match: re.Match) -> str:
        image = out_dir / match.group(1)
        if not image.exists():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(image.read_bytes()).decode()}"'

    body = re.sub(r'src="([^"/:]+\.png)"', embed, body)
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{CSS}</style></head><body>{body}</body></html>"
    path = out_dir / name
    path.write_text(page)
    return path

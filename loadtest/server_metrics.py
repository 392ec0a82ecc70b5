"""Server-side metrics during a load test: scrape Prometheus endpoints, derive time series, plot them.

The client sees one latency; the servers know where it went. `Scraper` polls the gateway's, Triton's
and vLLM's `/metrics` (and the GPUs, where there are any) while the load runs and appends the raw
samples to a CSV. `derive` turns counters into per-interval rates and means on the client's time axis, and
`summary` gives the "where time goes" table; loadtest/report/plots.py's `plot_servers` draws them.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
import subprocess
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import numpy as np

from core import metric_names

log = logging.getLogger(__name__)
COLUMNS = ("time", "target", "metric", "labels", "value")
TRITON = (  # Triton 2.51 counters, label `model` (and `version`; failures also by `reason`)
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count", "nv_inference_exec_count",
    "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us", "nv_inference_compute_output_duration_us",
    "nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model")  # the response cache, where a model has one
VLLM = (  # vLLM 0.10+, label `model_name` (and `engine`); gpu_cache_usage_perc is the older name of the KV gauge
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:generation_tokens_total", "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")  # prompt tokens found in its prefix cache, of asked
GATEWAY = (metric_names.IN_FLIGHT, metric_names.QUEUED, metric_names.SHED,
           f"{metric_names.REQUEST_SECONDS}_sum", f"{metric_names.REQUEST_SECONDS}_count",
           f"{metric_names.BACKEND_SECONDS}_sum", f"{metric_names.BACKEND_SECONDS}_count",
           f"{metric_names.OVERHEAD_SECONDS}_sum", f"{metric_names.OVERHEAD_SECONDS}_count",
           metric_names.ANSWER_CACHE_LOOKUPS, metric_names.ANSWER_CACHE_BYTES)
SWAPS = {metric_names.MODEL_LOADS: "load", metric_names.MODEL_UNLOADS: "unload"}  # on-demand models, by model
GPU = ("gpu_utilization_percent", "gpu_memory_used_bytes")
KEEP = frozenset(TRITON + VLLM + GATEWAY + tuple(SWAPS))  # only what derive() reads: histogram buckets would be most of the file
PROBE_ROUTES = frozenset({"/metrics", "/healthz", "/readyz", "/health"})  # not model traffic


class Row(NamedTuple):
    time: float  # epoch seconds
    target: str  # the scraped URL, or "gpu"
    metric: str
    labels: dict
    value: float


@dataclass
class Series:
    x: np.ndarray  # seconds since the load test's start (the end of the interval, for rates and means)
    y: np.ndarray  # NaN where an interval measured nothing (no new requests, a counter reset)
    unit: str
    panel: str  # "time", "throughput", "triton", "queues", "kv" (the caches) or "gpu"
    role: str  # what is measured ("queue", "compute", "rps", ...); plot() picks its lines by it
    subject: str = ""  # the model, backend or GPU it belongs to
    w: np.ndarray | None = None  # the requests behind each mean, so that summary() weighs by them


class Scraper:
    """Polls each URL every `interval_s` seconds and appends the samples `derive` uses to a CSV.

    Each URL (and the GPUs, where there are any) has its own daemon thread, so an endpoint that hangs
    until `timeout_s` does not stretch the others' intervals. A failed scrape is recorded in `errors`
    (URL -> last error message) and polling goes on; `scrapes` counts the answered ones per URL.

    Args:
        urls: Prometheus endpoints, e.g. ``http://127.0.0.1:8000/metrics``.
        out_path: The CSV to write (columns `COLUMNS`).
        interval_s: Seconds between two scrapes of one URL.
        timeout_s: Per-request timeout.
        headers: Sent with every request (e.g. the gateway's bearer token).
    """

    def __init__(self, urls: list[str], out_path: Path, interval_s: float = 1.0, timeout_s: float = 2.0,
                 headers: dict | None = None):
        self.urls, self.out_path = list(urls), Path(out_path)
        self.interval_s, self.timeout_s, self.headers = interval_s, timeout_s, dict(headers or {})
        self.errors: dict[str, str] = {}
        self.scrapes: dict[str, int] = {}
        self._stop, self._lock, self._threads = threading.Event(), threading.Lock(), []

    def start(self) -> Scraper:
        """Opens the CSV and starts polling; each target's first scrape happens at once."""
        import httpx

        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out_path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        self._client = httpx.Client(timeout=self.timeout_s, headers=self.headers)
        jobs = [(url, partial(self._get, url)) for url in self.urls] + [("gpu", g) for g in [_gpu_reader()] if g]
        for name, read in jobs:
            self._threads.append(threading.Thread(target=self._poll, args=(name, read), daemon=True))
            self._threads[-1].start()
        return self

    def stop(self) -> None:
        """Takes one last scrape of each target, joins the threads and closes the file."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        if self._file is not None:
            self._client.close()
            self._file.close()
            self._file = None
        self._threads = []

    def _poll(self, name: str, read) -> None:
        due = time.monotonic()
        while True:
            self._tick(name, read)
            due += self.interval_s  # a fixed cadence: one slow scrape does not shift the later ones
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return self._tick(name, read)  # closes the last interval at the end of the load

    def _tick(self, name: str, read) -> None:
        try:
            stamp, samples = read()
        except Exception as e:  # any failure of one endpoint is reported, never fatal to the load test
            if name not in self.errors:
                log.warning("scraping %s failed: %s", name, e)
            first_line = next(iter(str(e).splitlines()), "")  # httpx appends a help link on a line of its own
            self.errors[name] = f"{type(e).__name__}: {first_line}"[:300]
            return
        with self._lock:
            self.scrapes[name] = self.scrapes.get(name, 0) + 1
            self._writer.writerows((f"{stamp:.3f}", name, m, json.dumps(lab, sort_keys=True), v)
                                   for m, lab, v in samples)
            self._file.flush()  # a run that crashes keeps what it measured

    def _get(self, url: str) -> tuple[float, list]:
        before = time.time()
        response = self._client.get(url)
        response.raise_for_status()
        return (before + time.time()) / 2, parse(response.text)  # the moment the server rendered the values


def parse(text: str) -> list[tuple[str, dict, float]]:
    """(metric, labels, value) of the samples named in `KEEP`, from Prometheus exposition text.

    prometheus_client's parser renames counter samples to OpenMetrics' `<name>_total`; Triton's
    counters have no such suffix, so a name is matched with and without it and kept as exposed.
    """
    from prometheus_client.parser import text_string_to_metric_families

    named = ((s, s.name if s.name in KEEP else s.name.removesuffix("_total"))
             for family in text_string_to_metric_families(text) for s in family.samples)
    return [(name, s.labels, s.value) for s, name in named if name in KEEP]


def capacity_used(client, metrics_url: str) -> dict[str, dict]:
    """Per model with a confirmed capacity (serve/gateway/fleet/headroom.py), from a gateway's /metrics (summed over
    its workers) through `client` (an httpx.Client): its capacity in requests/s, the share of it the last seconds
    used, and whether the box changed since it was measured (stale); {} where no gateway answers there."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    keys = {metric_names.CAPACITY_RPS: "requests_per_second", metric_names.CAPACITY_USED: "used_ratio"}
    found: dict[str, dict] = {}
    try:
        answer = client.get(metrics_url)
        for family in text_string_to_metric_families(answer.text) if answer.status_code == 200 else ():
            for sample in family.samples if family.name in keys else ():
                entry = found.setdefault(sample.labels["model"], {"stale": sample.labels.get("stale") == "true"})
                entry[keys[family.name]] = sample.value
    except (httpx.HTTPError, ValueError):  # no gateway there (another server's /metrics, or none): nothing recorded
        return {}
    return found


def _nvidia_smi() -> list[tuple[str, float, float]]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5, check=True)
    # "[N/A]" (a MIG slice has no utilization of its own) becomes NaN, which is not written.
    num = lambda s: float(s) if s.strip().replace(".", "", 1).isdigit() else float("nan")  # noqa: E731
    return [(i.strip(), num(u), num(m) * 2**20) for i, u, m in (line.split(",") for line in out.stdout.splitlines())]


def _gpu_reader():
    """A function returning (time, samples) for every GPU, or None where there is no GPU to read."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        read = lambda: [(str(i), float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),  # noqa: E731
                         float(pynvml.nvmlDeviceGetMemoryInfo(h).used)) for i, h in enumerate(handles)]
    except Exception:  # no pynvml, or no driver behind it: nvidia-smi may still answer
        if not shutil.which("nvidia-smi"):
            return None
        read = _nvidia_smi
    try:
        if not read():
            return None
    except Exception:  # nvidia-smi without a working driver: a machine without a GPU, not an error
        return None
    return lambda: (time.time(), [(metric, {"gpu": i}, v) for i, *values in read()
                                  for metric, v in zip(GPU, values) if v == v])


def load(path: Path) -> list[Row]:
    """Reads a CSV written by `Scraper`."""
    with open(path, newline="") as f:
        return [Row(float(r["time"]), r["target"], r["metric"], json.loads(r["labels"]), float(r["value"]))
                for r in csv.DictReader(f)]


class Swap(NamedTuple):
    t: float  # seconds since the load test's start: the scrape that first saw it
    model: str
    what: str  # "load" / "unload" (a failed load included: its outcome says so)
    outcome: str  # loaded / failed (loads), idle / room (unloads)


def swap_events(rows: list[Row], t0: float) -> list[Swap]:
    """The on-demand models' loads and unloads during the run, each at the scrape whose counter first counted it
    (within a scrape interval of when it happened), from the gateway's counters."""
    first = {}  # each target's first scrape: the baseline, what came before the run
    for row in rows:
        first[row.target] = min(first.get(row.target, row.time), row.time)
    last: dict[tuple, float] = {}
    events = []
    for row in sorted((r for r in rows if r.metric in SWAPS), key=lambda r: r.time):
        outcome = row.labels.get("outcome") or row.labels.get("reason") or ""
        key = (row.target, row.metric, row.labels.get("model", ""), outcome)
        # a series that appears after the first scrape counted from 0: a label set appears on its first use
        before = last.get(key, 0.0 if row.time > first[row.target] else None)
        last[key] = row.value
        if before is not None and row.value > before:
            events += [Swap(row.time - t0, key[2], SWAPS[row.metric], outcome)] * int(row.value - before)
    return events


def _increase(m: np.ndarray) -> np.ndarray:
    """Per-interval increase of a group of counters (rows: series, columns: scrapes).

    A series absent at the previous scrape counts from 0 (a label set appears on its first use). One
    that goes down or disappears was reset (a restart): that interval is NaN, never a negative rate.
    """
    prev, cur = m[:, :-1], m[:, 1:]
    d = cur - np.nan_to_num(prev)
    d[np.isnan(prev) & np.isnan(cur)] = 0.0
    d[d < 0] = np.nan
    return d.sum(axis=0)


def _level(m: np.ndarray, how=np.nansum) -> np.ndarray:
    """A group of gauges combined per scrape; NaN where none of them was there."""
    out, present = np.full(m.shape[1], np.nan), ~np.isnan(m).all(axis=0)
    out[present] = how(m[:, present], axis=0)
    return out


def _ratio(num: np.ndarray, den: np.ndarray, scale: float) -> np.ndarray:
    with np.errstate(all="ignore"):  # 0/0 (no new requests) is NaN by design
        return np.where(den > 0, num / den * scale, np.nan)


_ALL = lambda labels: True  # noqa: E731


class _Target:
    """One target's samples as arrays over its scrape times (NaN where absent), and what is derived."""

    def __init__(self, rows: list[Row], t0: float):
        self.times, self.t0, self.found = np.array(sorted({r.time for r in rows})), t0, []
        self.dt, self.nan = np.diff(self.times), np.full(len(self.times) - 1, np.nan)
        at, self.series = {t: i for i, t in enumerate(self.times)}, {}
        for r in rows:
            key = (r.metric, json.dumps(r.labels, sort_keys=True))
            self.series.setdefault(key, (r.labels, np.full(len(self.times), np.nan)))[1][at[r.time]] = r.value

    def groups(self, metric: str, by: str = "", keep=_ALL) -> dict[str, np.ndarray]:
        """Per value of label `by` (one group "" without it): a matrix, series x scrapes."""
        out = defaultdict(list)
        for (name, _), (labels, values) in self.series.items():
            if name == metric and keep(labels):
                out[labels.get(by, "")].append(values)
        return {group: np.array(m) for group, m in out.items()}

    def inc(self, metric: str, by: str = "", keep=_ALL) -> dict[str, np.ndarray]:
        return {group: _increase(m) for group, m in self.groups(metric, by, keep).items()}

    def add(self, name, y, unit, panel, role, subject="", w=None, gauge=False) -> None:
        x = (self.times if gauge else self.times[1:]) - self.t0
        self.found.append((name, Series(x, y, unit, panel, role, subject, w)))

    def mean(self, name, total, n, scale, role, subject="", panel="time") -> None:
        """A mean per request in ms; `n` (requests per interval) is kept as summary()'s weights."""
        self.add(name, _ratio(total, n, scale), "ms/request", panel, role, subject, w=n)


def _triton(tg: _Target) -> None:
    triton = {metric: tg.inc(metric, "model") for metric in TRITON}
    for model, n in triton["nv_inference_request_success"].items():
        get = lambda metric: triton[metric].get(model, tg.nan)  # noqa: E731
        tg.add(f"triton {model} requests/s", n / tg.dt, "req/s", "throughput", "rps", model)
        tg.add(f"triton {model} failures/s", get("nv_inference_request_failure") / tg.dt, "req/s", "throughput",
               "failures", model)
        tg.mean(f"triton {model} queue", get("nv_inference_queue_duration_us"), n, 1e-3, "queue", model, "triton")
        compute = sum(get(f"nv_inference_compute_{step}_duration_us") for step in ("input", "infer", "output"))
        tg.mean(f"triton {model} compute", compute, n, 1e-3, "compute", model, "triton")
        hits = get("nv_cache_num_hits_per_model")
        looked_up = hits + get("nv_cache_num_misses_per_model")
        tg.add(f"triton {model} cache hits", _ratio(hits, looked_up, 100.0), "%", "triton", "cache", model, w=looked_up)
        batches = get("nv_inference_exec_count")
        tg.add(f"triton {model} batch size", _ratio(get("nv_inference_count"), batches, 1.0), "requests/batch",
               "triton", "batch", model, w=batches)


def _vllm(tg: _Target) -> None:
    for role in ("running", "waiting"):  # summed over engines
        for model, m in tg.groups(f"vllm:num_requests_{role}", "model_name").items():
            tg.add(f"vllm {model} {role}", _level(m), "requests", "queues", role, model, gauge=True)
    kv = "vllm:kv_cache_usage_perc" if tg.groups("vllm:kv_cache_usage_perc") else "vllm:gpu_cache_usage_perc"
    for model, m in tg.groups(kv, "model_name").items():  # a fraction per engine: their mean, in percent
        tg.add(f"vllm {model} KV cache", 100 * _level(m, np.nanmean), "%", "kv", "kv", model, gauge=True)
    hits = tg.inc("vllm:prefix_cache_hits_total", "model_name")  # in prompt tokens
    for model, asked in tg.inc("vllm:prefix_cache_queries_total", "model_name").items():
        tg.add(f"vllm {model} prefix cache hits", _ratio(hits.get(model, tg.nan), asked, 100.0), "%", "kv",
               "prefix_hits", model, w=asked)
    for model, n in tg.inc("vllm:generation_tokens_total", "model_name").items():
        tg.add(f"vllm {model} generated tokens/s", n / tg.dt, "tokens/s", "throughput", "tokens", model)
    waited = tg.inc("vllm:request_queue_time_seconds_sum", "model_name")
    for model, n in tg.inc("vllm:request_queue_time_seconds_count", "model_name").items():
        tg.mean(f"vllm {model} queue time", waited.get(model, tg.nan), n, 1e3, "vllm_queue", model)


def _gateway(tg: _Target) -> None:
    for metric, role in ((metric_names.IN_FLIGHT, "in flight"), (metric_names.QUEUED, "queued")):
        for m in tg.groups(metric).values():
            tg.add(f"gateway {role}", _level(m), "requests", "queues", role, gauge=True)
    for n in tg.inc(metric_names.SHED).values():
        tg.add("gateway shed/s", n / tg.dt, "req/s", "throughput", "shed")
    served = lambda labels: labels.get("route") not in PROBE_ROUTES  # noqa: E731
    spent = tg.inc(f"{metric_names.REQUEST_SECONDS}_sum", keep=served)
    for n in tg.inc(f"{metric_names.REQUEST_SECONDS}_count", keep=served).values():
        tg.mean("gateway request time", spent.get("", tg.nan), n, 1e3, "gateway")
    spent = tg.inc(f"{metric_names.OVERHEAD_SECONDS}_sum", keep=served)
    for n in tg.inc(f"{metric_names.OVERHEAD_SECONDS}_count", keep=served).values():
        tg.mean("gateway overhead", spent.get("", tg.nan), n, 1e3, "overhead")
    hit = lambda labels: labels.get("outcome") == "hit"  # noqa: E731
    hits = tg.inc(metric_names.ANSWER_CACHE_LOOKUPS, "model", keep=hit)
    for model, looked_up in tg.inc(metric_names.ANSWER_CACHE_LOOKUPS, "model").items():
        tg.add(f"gateway {model} answer cache hits", _ratio(hits.get(model, tg.nan), looked_up, 100.0), "%", "kv",
               "answer_hits", model, w=looked_up)
    for model, m in tg.groups(metric_names.ANSWER_CACHE_BYTES, "model").items():
        tg.add(f"gateway {model} answer cache", _level(m) / 2**20, "MiB", "kv", "answer_bytes", model, gauge=True)
    spent = tg.inc(f"{metric_names.BACKEND_SECONDS}_sum", "backend")
    for backend, n in tg.inc(f"{metric_names.BACKEND_SECONDS}_count", "backend").items():
        tg.mean(f"backend {backend} call time", spent.get(backend, tg.nan), n, 1e3, "backend", backend)


def _gpus(tg: _Target) -> None:
    for gpu, m in tg.groups(GPU[0], "gpu").items():
        tg.add(f"GPU {gpu} utilization", _level(m), "%", "gpu", "util", gpu, gauge=True)
    for gpu, m in tg.groups(GPU[1], "gpu").items():
        tg.add(f"GPU {gpu} memory used", _level(m) / 2**30, "GiB", "gpu", "memory", gpu, gauge=True)


def derive(rows: list[Row], t0: float) -> dict[str, Series]:
    """Turns raw samples into named series: counters as per-interval rates or means, gauges as read.

    Args:
        rows: Samples from `load`.
        t0: The load test's start (epoch seconds); x values are seconds since then.

    Returns:
        Series by readable name. Where several targets expose the same series (two vLLM engines), the
        target's host:port is appended to the name.
    """
    by_target, found = defaultdict(list), []
    for r in rows:
        by_target[r.target].append(r)
    for target, target_rows in by_target.items():
        tg = _Target(target_rows, t0)
        for step in (_triton, _vllm, _gateway, _gpus):  # each finds nothing on the other servers' targets
            step(tg)
        found += [(name, target, s) for name, s in tg.found if len(s.y) and not np.isnan(s.y).all()]
    names = Counter(name for name, _, _ in found)
    return {(f"{name} [{urlsplit(target).netloc or target}]" if names[name] > 1 else name): s
            for name, target, s in found}


def summary(series: dict[str, Series], warmup_s: float = 0.0) -> dict[str, dict]:
    """Per series: its mean and max over the measured window (x >= `warmup_s`), and its unit.

    Means per request are weighted by the requests of each interval, so a quiet second counts less.
    """
    out = {}
    for name, s in series.items():
        use = (s.x >= warmup_s) & np.isfinite(s.y)
        w = s.w[use] if s.w is not None and s.w[use].sum() > 0 else None
        y = s.y[use]
        out[name] = {"mean": float(np.average(y, weights=w)) if len(y) else float("nan"),
                     "max": float(y.max()) if len(y) else float("nan"), "unit": s.unit}
    return out

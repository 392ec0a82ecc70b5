"""Run a scenario headless as real locust processes (one, or a master with workers), with progress, the
servers' /metrics scraped beside it, and a report from the raw samples."""

from __future__ import annotations

import argparse
import copy
import csv
import json
import functools
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.machine import machine
from core.slo import parse_slo

from .report.pages import write_report
from .report.report import Summary, headline, load_samples, summarize
from .scenarios.apis import Load
from .scenarios.options import add_options, parse_pairs

SCENARIOS = Path(__file__).parent / "scenarios"
CPU_BOUND = 0.9  # a locust process busier than this (cores) was the bottleneck, not the server


def scenario_parser() -> argparse.ArgumentParser:
    """An argparse parser holding exactly the scenario options locust is given (see scenarios/options.py)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_options(parser)
    return parser


def scenario_options(**overrides) -> dict:
    """The scenario options' defaults with `overrides` (keys as argparse dests, e.g. max_in_flight)."""
    options = vars(scenario_parser().parse_args([]))
    unknown = set(overrides) - set(options)
    if unknown:
        raise ValueError(f"unknown scenario option(s): {', '.join(sorted(unknown))}")
    return options | overrides


def scenario_argv(options: dict) -> list[str]:
    """Locust command-line arguments for the options that differ from their defaults."""
    argv = []
    for action in scenario_parser()._actions:
        value = options.get(action.dest, action.default)
        if value == action.default or action.dest == "help":
            continue
        flag = action.option_strings[-1]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv


@dataclass
class LoadSpec:
    """One load run: where, how much, for how long, and what each request sends (`options`)."""

    host: str
    options: dict = field(default_factory=scenario_options)
    users: int = 8  # closed loop; an open loop runs one arrival schedule per process
    spawn_rate: float | None = None  # users started per second; None: all at once (within 10 ms, as vllm bench serve)
    duration_s: float = 30.0
    warmup_s: float = 5.0
    workers: int = 0  # 0: one locust process; N: a master and N workers
    slo: str = ""  # e.g. "ttft:500,e2el:2000" (ms): goodput counts the requests within every limit
    scrape: list[str] = field(default_factory=list)  # /metrics URLs to scrape beside the gateway's
    scrape_host: bool = True  # the host's own /metrics too (off: nothing but the load touches the host)

    @property
    def open_loop(self) -> bool:
        return self.options["arrival"] != "closed"

    @property
    def replaying(self) -> bool:
        return self.options["scenario"] == "replay"

    @functools.cached_property
    def trace(self):
        """--scenario replay: the trace (loadtest.scenarios.replayer.Trace), read and checked once."""
        from .scenarios.replayer import from_options

        return from_options(argparse.Namespace(**self.options))

    def models(self) -> list[str]:
        if self.replaying:
            return self.trace.models()
        if self.options["scenario"] == "mix":
            from .scenarios.options import parse_mix

            return sorted({model for _, model, _ in parse_mix(self.options["mix"])})
        return [m.strip() for m in self.options["model"].split(",") if m.strip()]

    def check(self) -> None:
        """Refuse a run that cannot work, before any load (the workload is built once here to check it)."""
        o = self.options
        stages = parse_pairs(o["stages"], "--stages")
        if self.users < 1 or (self.duration_s <= 0 and not self.replaying) or self.warmup_s < 0 or self.workers < 0:
            raise ValueError("need users >= 1, duration > 0, warm-up >= 0 and workers >= 0")
        if self.warmup_s >= self.duration:
            raise ValueError(f"the warm-up ({self.warmup_s:g}s) must be shorter than the run ({self.duration:g}s)")
        if self.open_loop and o["rate"] <= 0 and not stages and not self.replaying:
            raise ValueError(f"--arrival {o['arrival']} needs --rate > 0 (or --stages of rates)")
        if o["burstiness"] <= 0 or o["max_in_flight"] < 1:
            raise ValueError("--burstiness must be > 0 and --max-in-flight >= 1")
        parse_slo(self.slo)
        Load.from_options(argparse.Namespace(**o), trace=self.trace if self.replaying else None)

    @property
    def ends_with_trace(self) -> bool:
        """A replay of a trace once through: it ends when the trace's last request has been answered."""
        return self.replaying and not self.options["loop_trace"]

    @property
    def duration(self) -> float:
        """The run's length: --stages set it when given; a replay's is its trace's span and two seconds (what it is
        expected to take: it ends when its last request is answered, earlier or later)."""
        if self.ends_with_trace:
            return math.ceil(self.trace.duration_s) + 2.0
        stages = parse_pairs(self.options["stages"], "--stages")
        return sum(s for s, _ in stages) if stages else self.duration_s

    def locust_argv(self, out_dir: Path) -> list[str]:
        """The locust command for this run (pure: no process is started)."""
        files = str(SCENARIOS / "locustfile.py")
        users = self.users
        if self.open_loop:
            users = max(1, self.workers)  # one arrival schedule per process
        elif self.options["stages"]:
            files += f",{SCENARIOS / 'stages.py'}"
        # A replay ends when its last request is answered (the locustfile stops locust then); its time limit is only
        # a bound: the trace's clock starts when locust has read the trace, which on a busy box is seconds after `-t`'s.
        limit = self.duration + (self.options["request_timeout"] if self.ends_with_trace else 0)
        argv = [sys.executable, "-m", "locust", "-f", files, "--headless", "--only-summary", "-u", str(users),
                "-r", f"{self.spawn_rate or 100 * users:g}", "-t", f"{math.ceil(limit)}s", "--host", self.host,
                # Requests in flight at the end finish (or time out) and are counted, never dropped unrecorded.
                "--stop-timeout", f"{math.ceil(self.options['request_timeout'])}", "--csv", str(out_dir / "locust"),
                "--loglevel", "WARNING",
                *scenario_argv(self.options), "--samples-out", str(out_dir / "samples.csv")]
        if self.workers:
            argv += ["--processes", str(self.workers)]
        return argv

    def settings(self) -> dict:
        o = self.options
        shown = {"scenario": o["scenario"], "host": self.host, "arrival": o["arrival"], "duration_s": self.duration,
                 "warm-up (s)": self.warmup_s, "locust processes": f"{self.workers} workers + master" if self.workers else 1}
        if self.replaying:
            trace = self.trace
            shown |= {"trace": f"{o['trace']} ({trace.format}, {len(trace.requests)} requests over "
                               f"{trace.duration_s:.1f} s, {trace.block_tokens} tokens a block)",
                      "speed": o["speed"], "max in flight": o["max_in_flight"]}
        else:
            shown |= {"rate (req/s)": o["rate"], "burstiness": o["burstiness"], "max in flight": o["max_in_flight"]} \
                if self.open_loop else {"users": self.users}
        defaults = scenario_options()
        changed = {k: v for k, v in o.items() if v != defaults[k] and k not in shown and k != "api_key"}
        return shown | changed | ({"SLO (ms)": self.slo} if self.slo else {})


@dataclass
class RunResult:
    summary: Summary
    report: Path
    out_dir: Path


def auth_headers(options: dict) -> dict:
    return {"Authorization": f"Bearer {options['api_key']}"} if options.get("api_key") else {}


def check_target(spec: LoadSpec, timeout_s: float = 5.0) -> None:
    """Fail before any load when nothing answers at the host, or a model is not served there: a run against
    a wrong address or name would otherwise fill a report with errors."""
    host = spec.host.rstrip("/")
    try:
        answer = httpx.get(f"{host}/v1/models", headers=auth_headers(spec.options), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ValueError(f"nothing answers at {spec.host} ({type(exc).__name__}: {exc}); start the gateway "
                         "(`rtxserve serve gateway`) or pass --host") from None
    if answer.status_code in (401, 403):
        raise ValueError(f"{host}/v1/models refused the key (HTTP {answer.status_code}); pass --api-key")
    if answer.status_code != 200:
        return  # not our gateway (another OpenAI-style server may lack the list): let the run tell
    listed = answer.json().get("data", [])
    served = {m.get("id") for m in listed}
    missing = [m for m in spec.models() if m not in served]
    if missing:
        hint = "; point the trace's models at served ones with --models OLD=NEW" if spec.replaying else ""
        raise ValueError(f"model {', '.join(missing)} is not served at {host}; served: "
                         f"{', '.join(sorted(served)) or 'none'}{hint}")
    if spec.replaying and not spec.options["send_anyway"]:
        from .scenarios.fitting import over_context

        refused = over_context(spec.trace, contexts(listed))
        if refused:
            raise ValueError(refused)


def contexts(listed: list[dict]) -> dict[str, int]:
    """Each listed model's context (`max_model_len`, as vLLM and the gateway list an engine's models)."""
    return {m["id"]: int(m["max_model_len"]) for m in listed if isinstance(m.get("max_model_len"), int)}


class _Progress:
    """Requests and failures so far, from the stats CSV locust rewrites every second (or, `last`, the latest
    aggregated row of the history it appends to every second)."""

    def __init__(self, path: Path, last: bool = False):
        self.path, self.last = path, last

    def row(self) -> dict:
        found = {}
        try:
            with open(self.path, newline="") as f:
                for row in csv.DictReader(f):
                    if row.get("Name") == "Aggregated":
                        found = row
                        if not self.last:
                            break
        except (OSError, csv.Error):
            pass
        return found

    def __call__(self) -> tuple[int, int]:
        row = self.row()
        try:
            return int(row["Request Count"]), int(row["Failure Count"])
        except (KeyError, ValueError):
            return 0, 0


class _CpuWatch:
    """CPU seconds of each locust process, sampled while they run (psutil, which locust itself depends on)."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.seconds: dict[int, float] = {}

    def sample(self) -> None:
        import psutil

        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for p in processes:
            try:
                t = p.cpu_times()
                self.seconds[p.pid] = t.user + t.system
            except psutil.Error:
                pass

    def figures(self, wall_s: float, root_pid: int) -> dict:
        senders = {pid: s for pid, s in self.seconds.items() if pid != root_pid or len(self.seconds) == 1}
        busiest = max(senders.values(), default=0.0) / wall_s if wall_s else 0.0
        return {"cores_total": round(sum(self.seconds.values()) / wall_s, 2) if wall_s else 0.0,
                "busiest_process_cores": round(busiest, 2), "processes": len(self.seconds),
                "cpu_bound": busiest >= CPU_BOUND}


def run(spec: LoadSpec, out_dir: Path, *, progress_every_s: float = 5.0, log=print, stop_early=None) -> RunResult:
    """Run `spec` with real locust, write the report into `out_dir`, and return the summary. `stop_early`, given
    locust's latest aggregated stats row each second, returns why to stop the run now ('' to go on): locust is then
    sent SIGTERM (its graceful end), and the report covers what was done (`settings["stopped early"]` says why).

    Raises ValueError for a run that cannot work (checked before any load) and RuntimeError if locust itself failed.
    """
    from .server_metrics import Scraper

    spec = _checked(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = spec.locust_argv(out_dir)
    shown = " ".join(a if a != spec.options.get("api_key") else "***" for a in command)
    (out_dir / "command.txt").write_text(shown + "\n")
    what = (f"replay of {Path(spec.options['trace']).name} at {spec.options['speed']:g}x" if spec.replaying else
            f"{spec.options['rate']:g} req/s ({spec.options['arrival']})" if spec.open_loop else f"{spec.users} users")
    log(f"locust: {what} on {spec.host} for {spec.duration:g}s ({spec.options['scenario']}); command: {shown}")
    urls = [f"{spec.host.rstrip('/')}/metrics"] if spec.scrape_host else []
    scraper = Scraper([*urls, *spec.scrape], out_dir / "server_metrics.csv",
                      headers=auth_headers(spec.options)).start()
    started = time.monotonic()
    try:
        with open(out_dir / "locust.log", "wb") as locust_log:
            process = subprocess.Popen(command, stdout=locust_log, stderr=subprocess.STDOUT, start_new_session=True)
            cpu = _CpuWatch(process.pid)
            stopped = _follow(process, cpu, spec, out_dir, started, progress_every_s, log, stop_early)
    finally:
        scraper.stop()
    wall = time.monotonic() - started
    samples = load_samples(out_dir / "samples.csv") if (out_dir / "samples.csv").exists() else None
    if process.returncode not in (0, 1) or samples is None or len(samples.end) == 0:  # 1: locust saw failures
        tail = (out_dir / "locust.log").read_text(errors="replace")[-2000:]
        count = 0 if samples is None else len(samples.end)
        raise RuntimeError(f"locust exited with code {process.returncode} after {count} requests:\n{tail}")
    load_cpu = cpu.figures(wall, process.pid)
    if "CPU usage above" in (out_dir / "locust.log").read_text(errors="replace"):
        load_cpu["cpu_bound"] = True  # locust's own warning
    settings = spec.settings() | {"load generator": load_cpu, "machine": machine()} | (
        {"stopped early": stopped} if stopped else {})
    summary = summarize(samples, spec.warmup_s, settings, parse_slo(spec.slo))
    if spec.replaying:
        from . import server_metrics
        from .report.replayed import compare

        scraped = out_dir / "server_metrics.csv"
        figures = server_metrics.summary(server_metrics.derive(server_metrics.load(scraped), float(samples.start.min())),
                                         spec.warmup_s) if scraped.exists() else {}
        summary.replay = compare(spec.trace, samples, figures) | {"capacity": against_capacity(spec)}
    images = spec.options.get("chat_images") or 0
    scenario = spec.options["scenario"] + (f" with {images} image{'s' * (images > 1)} per request" if images else "")
    title = f"rtxserve load test: {scenario}, {what}"
    report = write_report(summary, samples, out_dir, title, scrape_errors=scraper.errors)
    log(f"done: {headline(summary)}")
    return RunResult(summary, report, out_dir)


def against_capacity(spec: LoadSpec) -> dict[str, dict]:
    """A replay's rate per model against the box's confirmed capacity of it, where the gateway at the host has one
    (`rtxserve capacity --record`): how close the replayed traffic ran to what the box holds."""
    from .server_metrics import capacity_used

    trace = spec.trace
    with httpx.Client(headers=auth_headers(spec.options), timeout=10) as client:
        recorded = capacity_used(client, f"{spec.host.rstrip('/')}/metrics")
    seconds = max(trace.duration_s, 1e-3)
    out = {}
    for model, n in sorted(Counter(r.model for r in trace.requests).items()):
        if recorded.get(model, {}).get("requests_per_second"):
            capacity = recorded[model]["requests_per_second"]
            out[model] = {"replayed_rps": round(n / seconds, 3), "capacity_rps": capacity,
                          "share": round(n / seconds / capacity, 3), "stale": recorded[model]["stale"]}
    return out


def _checked(spec: LoadSpec) -> LoadSpec:
    """`spec`, checked (and its target) before any load; a replay without calibration gets one measured on the
    target now (on a copy: the caller's spec is left as it was)."""
    spec.check()
    check_target(spec)
    if spec.replaying and not spec.options["calibration"]:
        from .scenarios.replayer import calibrate

        spec = copy.deepcopy(spec)
        spec.options["calibration"] = json.dumps(calibrate(spec.host, auth_headers(spec.options), spec.trace))
    return spec


def _follow(process: subprocess.Popen, cpu: _CpuWatch, spec: LoadSpec, out_dir: Path, started: float,
            progress_every_s: float, log, stop_early) -> str:
    """Wait for locust to end, sampling its CPU, logging progress every `progress_every_s` and asking `stop_early`
    (see run); returns why it was stopped early ('' if it was not). Ctrl-C stops locust and its workers first."""
    progress = _Progress(out_dir / "locust_stats.csv")
    history = _Progress(out_dir / "locust_stats_history.csv", last=True)
    stopped = ""
    try:
        next_line = progress_every_s
        while process.poll() is None:
            try:
                process.wait(0.5)
            except subprocess.TimeoutExpired:
                cpu.sample()
                elapsed = time.monotonic() - started
                if stop_early is not None and not stopped and (row := history.row()) \
                        and (stopped := stop_early(row)):
                    log(f"  stopping early: {stopped}")
                    os.killpg(process.pid, signal.SIGTERM)  # locust's graceful end: what it has is written
                if elapsed >= next_line:
                    requests, failures = progress()
                    log(f"  {min(elapsed, spec.duration):4.0f}/{spec.duration:g}s  {requests} requests, {failures} failed")
                    next_line += progress_every_s
    except KeyboardInterrupt:
        _stop_group(process)  # locust and its workers: nothing is left running
        raise
    return stopped


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
            process.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue

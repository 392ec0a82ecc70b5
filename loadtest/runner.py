"""Run a locust scenario headless as a real locust process, with progress, and report on it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .report import Summary, headline, load_samples, summarize, write_report

SCENARIOS = Path(__file__).parent / "scenarios"


def scenario_path(name: str) -> Path:
    path = SCENARIOS / f"{name}.py"
    available = sorted(p.stem for p in SCENARIOS.glob("*.py") if p.stem not in {"__init__", "samples"})
    if name not in available:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(available)}")
    return path


@dataclass
class RunResult:
    summary: Summary
    report: Path
    out_dir: Path


class _LineCounter:
    """Counts the sample rows written so far, reading only what was appended since the last call."""

    def __init__(self, prefix: Path):
        self.prefix = prefix
        self.seen: dict[Path, tuple[int, int]] = {}  # file -> (bytes read, lines)

    def __call__(self) -> int:
        for path in self.prefix.parent.glob(self.prefix.name + ".*"):
            offset, lines = self.seen.get(path, (0, 0))
            with open(path, "rb") as f:
                f.seek(offset)
                new = f.read()
            self.seen[path] = (offset + len(new), lines + new.count(b"\n"))
        return sum(lines for _, lines in self.seen.values())


def check_reachable(host: str, timeout_s: float = 5.0) -> None:
    """Fail before any load when nothing answers at `host`: a run against a wrong address would otherwise
    fill a report with connection errors. Any HTTP answer counts (401 or 404 still means a server is there)."""
    try:
        httpx.get(f"{host.rstrip('/')}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ValueError(f"nothing answers at {host} ({type(exc).__name__}: {exc}); start the gateway "
                         "(`rtxserve serve gateway`) or pass --host") from None


def run(
    scenario: str,
    host: str,
    out_dir: Path,
    *,
    users: int = 8,
    spawn_rate: float | None = None,
    duration_s: float = 30.0,
    warmup_s: float = 5.0,
    env: dict[str, str] | None = None,
    progress_every_s: float = 5.0,
    log=print,
) -> RunResult:
    """Run `scenario` against `host` for `duration_s` with `users` closed-loop users; write the report.

    Returns the summary and where the report is. Raises RuntimeError if locust itself failed.
    """
    if users < 1 or duration_s <= 0 or warmup_s < 0 or warmup_s >= duration_s:
        raise ValueError("need users >= 1, duration > 0 and 0 <= warm-up < duration")
    locustfile = scenario_path(scenario)
    check_reachable(host)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("samples.csv.*"):
        old.unlink()
    prefix = out_dir / "samples.csv"
    command = [
        sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "--only-summary",
        "-u", str(users), "-r", str(spawn_rate or users), "-t", f"{duration_s:g}s", "--host", host,
        "--stop-timeout", "10", "--csv", str(out_dir / "locust"), "--loglevel", "WARNING",
    ]
    child_env = {**os.environ, **(env or {}), "RTXSERVE_SAMPLES": str(prefix)}
    log(f"locust: {users} users on {host} for {duration_s:g}s ({scenario}); command: {' '.join(command)}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    count_requests = _LineCounter(prefix)
    with open(out_dir / "locust.log", "wb") as locust_log:
        process = subprocess.Popen(command, env=child_env, stdout=locust_log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            try:
                process.wait(progress_every_s)
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                log(f"  {min(elapsed, duration_s):4.0f}/{duration_s:g}s  {count_requests()} requests")
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    samples = load_samples(prefix)
    if process.returncode not in (0, 1) or len(samples.end) == 0:  # 1: locust saw failed requests
        tail = (out_dir / "locust.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"locust exited with code {process.returncode} after {len(samples.end)} requests:\n{tail}")
    settings = {
        "scenario": scenario, "host": host, "users": users, "duration_s": duration_s,
        "load generator CPU (cores, mean)": round(cpu / wall, 2),
        **{k.removeprefix("RTXSERVE_").lower(): v for k, v in (env or {}).items() if k.startswith("RTXSERVE_")},
    }
    summary = summarize(samples, warmup_s, settings)
    report = write_report(summary, samples, out_dir, f"rtxserve load test: {scenario}, {users} users")
    log(f"done: {headline(summary)}")
    return RunResult(summary, report, out_dir)

"""Where a server process's CPU goes under load (B1's `--profile-seconds`): py-spy samples its Python stacks while a
load runs, and each sample is charged to the code its innermost frame is in (its self time): the event loop, the HTTP
server, the ASGI framework, the gRPC client, the gateway's own files. What the gateway's own code spends is what a
change to it can win; the rest is the floor of the parts it is built on, which only a different design (fewer layers,
another server, another language) moves."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

OWN = "serve/gateway/"
# (part, path prefixes of the frames it owns), first match wins; a frame's path is as py-spy prints it (relative to
# sys.path: "asyncio/events.py", "serve/gateway/edge/hotpath.py")
PARTS = (
    ("the gateway's own code (serve/gateway/)", (OWN,)),
    ("event loop and sockets (asyncio, selectors)", ("asyncio/", "selectors.py", "socket.py", "uvloop/", "ssl.py")),
    ("HTTP server (uvicorn, httptools, h11)", ("uvicorn/", "httptools/", "h11/")),
    ("ASGI framework (starlette, fastapi)", ("starlette/", "fastapi/")),
    ("gRPC client (grpc.aio)", ("grpc/", "grpc_")),
    ("HTTP client (aiohttp)", ("aiohttp/", "yarl/", "multidict/")),
    ("Triton client and tensors (tritonclient, numpy)", ("tritonclient/", "numpy/")),
    ("validation and JSON (pydantic, json)", ("pydantic/", "pydantic_core/", "json/", "orjson")),
    ("metrics and logging (prometheus_client, logging)", ("prometheus_client/", "logging/", "opentelemetry/")),
)
OTHER = "other"


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """The user and system CPU seconds of `pid`, and of its live children unless told not to (a bench's own process,
    whose children are the servers it measures)."""
    process = psutil.Process(pid)
    total = sum(process.cpu_times()[:2])
    for child in process.children(recursive=True) if children else ():
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def system_calls(pid: int) -> tuple[int, int]:
    """The read and write system calls `pid` and its live children have made (their /proc/PID/io counts)."""
    reads = writes = 0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            counts = process.io_counters()
        except psutil.NoSuchProcess:
            continue
        reads, writes = reads + counts.read_count, writes + counts.write_count
    return reads, writes


def run_queue_seconds(pid: int) -> float:
    """The seconds the threads of `pid` and of its live children spent runnable but waiting for a core (the second
    field of each thread's /proc schedstat): on a box whose cores are all busy, what a server's wakeups wait for the
    scheduler beside the CPU it then uses. 0 where the kernel keeps no schedstat."""
    total = 0.0
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for process in processes:
        for stat in Path(f"/proc/{process.pid}/task").glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                pass
    return total


def _path(frame: str) -> str:
    """"func (path:line)" -> path."""
    inside = frame.rsplit(" (", 1)[-1].rstrip(")")
    return inside.rsplit(":", 1)[0]


def part_of(frame: str) -> str:
    path = _path(frame)
    for part, prefixes in PARTS:
        if path.startswith(prefixes):
            return part
    return OTHER


def summarize(raw: Iterable[str], top: int = 8) -> dict:
    """py-spy's raw (collapsed) output, a line per stack ("frame;frame;... count"): each part's share of the samples
    by self time (%), the shares spent under each of the gateway's own files (its innermost one in the stack), and
    the `top` innermost functions. A sample whose innermost Python frame is the loop's `run` is the event loop's C
    code (asyncio's tasks and futures, the selector) running no Python of ours."""
    parts, ours, leaves = Counter(), Counter(), Counter()
    for line in raw:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        n = int(count)
        parts[part_of(leaf)] += n
        leaves[leaf] += n
        own = [f for f in stack.split(";") if _path(f).startswith(OWN)]
        if own:
            ours[_path(own[-1])] += n  # the innermost of our frames: the file whose call the time is spent under
    total = sum(parts.values())
    if not total:
        raise ValueError("the profile holds no samples")
    share = lambda n: round(100 * n / total, 1)  # noqa: E731
    return {"samples": total,
            "parts": {p: share(parts[p]) for p, _ in sorted(parts.items(), key=lambda kv: -kv[1])},
            "under_own_files": {f: share(n) for f, n in ours.most_common(top)},
            "top": [(f, share(n)) for f, n in leaves.most_common(top)]}


def py_spy() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


@contextlib.contextmanager
def recording(pid: int, seconds: float, out: Path, rate: int = 200) -> Iterator[None]:
    """py-spy sampling `pid` (and its children: a gateway's workers) for `seconds` while the body runs; the raw stacks
    in `out`. Raises RuntimeError when py-spy is missing or could not attach (it needs ptrace: root or
    CAP_SYS_PTRACE)."""
    binary = py_spy()
    if binary is None:
        raise RuntimeError("py-spy is not installed (it comes with the dev extra: `make setup`)")
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen([binary, "record", "--pid", str(pid), "--subprocesses", "--duration", f"{seconds:g}",
                            "--rate", str(rate), "--format", "raw", "--output", str(out), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield
    finally:
        _, err = spy.communicate(timeout=seconds + 60)
    if spy.returncode != 0 or not out.exists():
        raise RuntimeError(f"py-spy failed ({spy.returncode}): {err.strip()[-300:]}")


def markdown(summary: dict, what: str, cpu_ms: float | None = None) -> list[str]:
    """The profile's tables; with `cpu_ms` (the gateway's CPU-ms a request, measured beside it), each part's share of
    it too."""
    lines = [f"Where the gateway's CPU went ({what}; py-spy, {summary['samples']} samples, each charged to the code "
             "its innermost frame is in):", "",
             "| part | share of the gateway's CPU |" + (" CPU-ms a request |" if cpu_ms else ""),
             "|---|---|" + ("---|" if cpu_ms else "")]
    lines += [f"| {part} | {pct} % |" + (f" {cpu_ms * pct / 100:.3f} |" if cpu_ms else "")
              for part, pct in summary["parts"].items()]
    lines += ["", "Under the gateway's own files (the time spent in calls they make, the parts above included):", "",
              "| file | share |", "|---|---|"]
    lines += [f"| `{f}` | {pct} % |" for f, pct in summary["under_own_files"].items()]
    lines += ["", "The innermost functions:", "", "| function | share |", "|---|---|"]
    lines += [f"| `{f}` | {pct} % |" for f, pct in summary["top"]]
    return lines


def plot(summary: dict, path: Path, title: str) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(summary["parts"]) + 1.4))
    parts = list(summary["parts"].items())[::-1]
    colours = ["tab:orange" if p.startswith("the gateway's own") else "tab:gray" for p, _ in parts]
    bars = ax.barh([p for p, _ in parts], [v for _, v in parts], color=colours)
    ax.bar_label(bars, fmt="%.1f %%", fontsize=8, padding=3)
    ax.set_xlabel("share of the gateway's CPU samples, %")
    ax.set_xlim(0, max(v for _, v in parts) * 1.2)
    return save(fig, path, title)

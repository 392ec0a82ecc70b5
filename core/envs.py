"""Where the servers' own environments are: `.envs/triton` and `.envs/vllm` (the Makefile and the bundle's
install.sh make them beside the main `.venv`), `.envs/ultralytics`, where YOLO exports run (the Makefile's
setup-ultralytics; never in a bundle), and `.envs/llmcompressor`, where LLMs are quantised (setup-quantize). Declared here once; found from any working directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TRITON = "triton"
VLLM = "vllm"
ULTRALYTICS = "ultralytics"
LLMCOMPRESSOR = "llmcompressor"
FOLDER = ".envs"  # beside the main environment, in a checkout or an installed bundle
ENVS_DIR_ENV = "RTXSERVE_ENVS_DIR"


def env_under(root: Path, name: str) -> Path:
    """The environment of one server in the checkout or bundle at `root` (which may be another host's path)."""
    return Path(root) / FOLDER / name


def envs_dir() -> Path:
    """RTXSERVE_ENVS_DIR, else the `.envs` beside the environment rtxserve runs in (a checkout's or a bundle's
    `.venv`), else `.envs` in the working directory."""
    if os.environ.get(ENVS_DIR_ENV):
        return Path(os.environ[ENVS_DIR_ENV]).expanduser()
    beside = Path(sys.prefix).parent / FOLDER
    return beside if beside.is_dir() else Path(FOLDER)


def env_dir(name: str) -> Path:
    """The environment of one server (TRITON or VLLM), or of an exporter's tool (ULTRALYTICS, LLMCOMPRESSOR)."""
    return envs_dir() / name

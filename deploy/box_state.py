"""A box's run folder: where `serve up` records what it started (`RUN/state.json`), and what reads it: which servers
run and how each is doing (`status`), the keeper's restarts, what promotions changed. deploy/box.py starts and stops
what it records."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import platformdirs
import psutil

from .spec import DeploymentError

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
            if any(members(r) for r in read_state(run)["servers"]):
                out.append(run)
    return out


def write_state(run: Path, state: dict) -> None:
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


def members(r: dict) -> list[psutil.Process]:
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
CAPACITY_FILE = "capacity.json"  # each model's confirmed capacity (`rtxserve capacity --record`), kept by the gateway
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
    gateway) the residency of each on-demand model and the share of each recorded capacity in use."""
    from loadtest.server_metrics import capacity_used

    out = []
    counted = restarts(run)
    with httpx.Client(timeout=2.0) as client:
        for r in read_state(run)["servers"]:
            processes = members(r)
            alive = any(p.pid == r["pid"] for p in processes)
            ready, on_demand, headroom = "-", {}, {}
            if alive:
                try:
                    answer = client.get(r["url"])
                    ready = str(answer.status_code)
                    if r["kind"] == "gateway":  # its /readyz says which on-demand models are loaded
                        on_demand = answer.json().get("on_demand") or {}
                        headroom = capacity_used(client, r["url"].rsplit("/", 1)[0] + "/metrics")
                except (httpx.HTTPError, ValueError) as exc:
                    ready = ready if ready != "-" else type(exc).__name__
            rss = sum(_rss(p) for p in processes)
            out.append({**r, "alive": alive, "ready": ready, "processes": len(processes), "rss_gib": rss / 1024**3,
                        "on_demand": on_demand, "headroom": headroom,
                        "restarts": counted.get(r["name"], {}).get("restarts", 0)})
    return out


def create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:  # it died already: anything of its group is younger than now
        return time.time() - 1


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0

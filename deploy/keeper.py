"""The keeper of a `serve up` box: a server that dies is started again, alone, with backoff, as systemd's
`Restart=on-failure` does for the rendered systemd box and Kubernetes' CrashLoopBackOff for its pods.

`serve up` starts it (deploy/box.py: a process of its own session, detached; `--restart no` does not) and records it in the run's
state.json; `serve down` stops it before anything else. Every INTERVAL_S it reads the state: a server whose process is
gone is started again by `serve up`'s own code (`up(only=...)`: what runs is left as it is, and a deployment file
changed since is refused as `serve up` refuses it). A server's first restart is at once; while it keeps dying within
RESET_AFTER_S of its last restart, each next one waits longer: 10 s, 20 s, 40 s ... 5 minutes (tenacity's exponential
wait, with Kubernetes' figures). Each server's restarts and failed starts go to RUN/restarts.json, which `serve
status` shows and the gateway's /metrics reports (core/metric_names.py: SERVER_RESTARTS). The keeper ends with the box (its
state.json gone) or when another keeper is recorded."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import tenacity

from .box import BoxBusy, up

from .box_state import RESTARTS_FILE, members, read_state, restarts
from .spec import DeploymentError
from .load import load_deployment

INTERVAL_S = 2.0
RESET_AFTER_S = 600.0  # a server that ran this long since its last restart starts its backoff again
BACKOFF = tenacity.wait_exponential(multiplier=10, max=300)


def backoff_s(restarts_in_a_row: int) -> float:
    """Seconds before the next restart of a server restarted `restarts_in_a_row` times without running RESET_AFTER_S."""
    if restarts_in_a_row < 1:
        return 0.0
    attempt = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
    attempt.attempt_number = restarts_in_a_row
    return BACKOFF(attempt)


class Keeper:
    def __init__(self, run: Path, log=print):
        self.run, self.log = run, log
        self.counts = restarts(run)  # name -> restarts, failures, last_restart, last_error (kept over keepers)
        self.in_a_row: dict[str, int] = {}
        self.due: dict[str, float] = {}  # a dead server -> when (time.time()) its restart may go

    def step(self) -> bool:
        """One look at the box; False once the keeper should end."""
        try:
            state = read_state(self.run)
        except DeploymentError:
            self.log("the box is down (no state.json): the keeper ends")
            return False
        recorded = state.get("keeper")
        if recorded and recorded["pid"] != os.getpid():
            self.log(f"another keeper is recorded (pid {recorded['pid']}): this one ends")
            return False
        now = time.time()
        dead = {r["name"] for r in state["servers"] if not any(p.pid == r["pid"] for p in members(r))}
        for name in dead - set(self.due):
            counted = self.counts.get(name, {})
            if now - counted.get("last_restart", 0) >= RESET_AFTER_S:
                self.in_a_row[name] = 0
            self.due[name] = now + backoff_s(self.in_a_row.get(name, 0))
            self.log(f"{name} is gone; starting it again in {self.due[name] - now:.0f} s")
        for name in set(self.due) - dead:  # started again by someone's `serve up`
            del self.due[name]
        ready = frozenset(name for name, at in self.due.items() if at <= now)
        if ready:
            self._restart(state, ready)
        return True

    def _restart(self, state: dict, names: frozenset[str]) -> None:
        opts = state["up"]
        try:
            up(load_deployment(Path(state["file"])), root=self.run.parent,
               envs={k: Path(v) for k, v in opts["envs"].items()}, timeout_s=opts["timeout_s"],
               tritonserver=opts["tritonserver"] and Path(opts["tritonserver"]),
               backend_directory=opts["backend_directory"] and Path(opts["backend_directory"]), only=names,
               log=self.log)
        except BoxBusy:
            return  # a `serve up` or `down` runs: look again next time
        except Exception as exc:  # noqa: BLE001 (a failed start is counted, said and tried again later)
            self._count(names, "failures", error=f"{type(exc).__name__}: {str(exc)[-500:]}")
            return
        self._count(names, "restarts")

    def _count(self, names: frozenset[str], what: str, error: str | None = None) -> None:
        now = time.time()
        for name in names:
            counted = self.counts.setdefault(name, {"restarts": 0, "failures": 0})
            counted[what] += 1
            counted["last_restart"] = now
            counted["last_error"] = error
            self.in_a_row[name] = self.in_a_row.get(name, 0) + 1
            self.due.pop(name, None)
            if error:
                self.due[name] = now + backoff_s(self.in_a_row[name])
                self.log(f"{name} did not start ({error}); next try in {self.due[name] - now:.0f} s")
            else:
                self.log(f"{name} started again (restart {counted['restarts']})")
        tmp = self.run / f".{RESTARTS_FILE}.new"
        tmp.write_text(json.dumps({"servers": self.counts}, indent=2))
        os.replace(tmp, self.run / RESTARTS_FILE)


def main(argv: list[str] | None = None) -> int:
    run = Path((argv or sys.argv[1:])[0]).resolve()

    def stop(signum, frame):  # a start in progress is undone by up's own cleanup
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    keeper = Keeper(run, log=lambda m: print(time.strftime("%Y-%m-%dT%H:%M:%S"), m, flush=True))
    while keeper.step():
        time.sleep(INTERVAL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())

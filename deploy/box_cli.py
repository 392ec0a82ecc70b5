"""`rtxserve serve up|status|down`: a whole box from its deployment file (deploy/box.py), beside serve's own
`triton`, `vllm` and `gateway` commands under `rtxserve serve`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from core.envs import TRITON, VLLM, env_dir
from serve.launcher import ServerStartError

from .box import RESTART_POLICIES, down, up

from .box_state import keeper_alive, promoted, read_state, restarts, run_dir, running, state_dir, status
from .spec import DeploymentError
from .load import load_deployment


def _up(args) -> int:
    try:
        deployment = load_deployment(args.deployment)
        run = up(deployment, root=args.state_dir, envs={"triton": args.triton_env, "vllm": args.vllm_env},
                 timeout_s=args.start_timeout, tritonserver=args.tritonserver, backend_directory=args.backend_directory,
                 restart=args.restart, log=lambda m: print(m, file=sys.stderr))
    except ServerStartError as exc:
        print(f"rtxserve serve up: error: {exc}", file=sys.stderr)
        return 1
    except (DeploymentError, OSError, ValueError) as exc:
        print(f"rtxserve serve up: error: {exc}", file=sys.stderr)
        return 2
    print(f"{deployment.name} runs from {run}: `rtxserve serve status {deployment.name}`, `rtxserve serve down {deployment.name}`")
    return _verify(deployment, run, args.api_key) if args.verify else 0


def _verify(deployment, run: Path, api_key: str) -> int:
    """`up --verify`: every model with a reference set held to it through the gateway (`rtxserve eval`); 1 where one
    drifted (the box stays up: its report says what)."""
    from core.reference import ReferenceError, ReferenceSet
    from loadtest.eval.report import write
    from loadtest.eval.run import evaluate

    from .box_target import BoxTarget, gateway_url

    target = BoxTarget(gateway_url(run), deployment, run)
    names = [n for m in deployment.models for n in (m.name, *getattr(m, "adapters", {}))]
    drifted = []
    for name in names:
        try:
            ref = ReferenceSet.read(target.artifact(name))
        except ReferenceError as exc:
            print(f"verify {name}: not verified ({exc})", file=sys.stderr)
            continue
        result = evaluate(target.url, name, ref, api_key=api_key)
        page = write(result, run / "verify" / name)
        print(f"verify {name}: {result.verdict()} ({page})")
        if not result.passed:
            drifted.append(name)
    if drifted:
        print(f"rtxserve serve up: error: {', '.join(drifted)} do not answer as they were trained (the box is up: "
              f"see the reports above, `rtxserve serve down {deployment.name}` to stop it)", file=sys.stderr)
        return 1
    return 0


def _run_of(args) -> Path:
    """A deployment's run folder from its name, its deployment file, or the folder itself."""
    target = Path(args.target)
    if target.is_file():
        return run_dir(load_deployment(target).name, args.state_dir)
    return target if (target / "state.json").exists() else run_dir(args.target, args.state_dir)


def _status(args) -> int:
    try:
        runs = [_run_of(args)] if args.target else running(args.state_dir)
        if not runs:
            print(f"no deployment runs from {args.state_dir or state_dir()}", file=sys.stderr)
            return 3
        servers = {run: status(run) for run in runs}
    except (DeploymentError, OSError) as exc:
        print(f"rtxserve serve status: error: {exc}", file=sys.stderr)
        return 3
    for run, rows in servers.items():
        print(f"{run.name} ({run})")
        print(f"  {'server':<28} {'kind':<8} {'pid':>8} {'process':<8} {'procs':>5} {'RSS GiB':>8} {'restarts':>8}  ready")
        for s in rows:
            print(f"  {s['name']:<28} {s['kind']:<8} {s['pid']:>8} {'alive' if s['alive'] else 'GONE':<8} "
                  f"{s['processes']:>5} {s['rss_gib']:>8.2f} {s['restarts']:>8}  {s['ready']} {s['url']}")
            by_state: dict[str, list[str]] = {}
            for model, state in s.get("on_demand", {}).items():
                by_state.setdefault(state, []).append(model)
            if by_state:
                print("    on demand: " + "; ".join(f"{state}: {', '.join(models)}" for state, models in sorted(by_state.items())))
            for model, h in sorted(s.get("headroom", {}).items()):
                print(f"    capacity: {model} uses {h.get('used_ratio', float('nan')):.0%} of "
                      f"{h.get('requests_per_second', float('nan')):.4g} requests/s"
                      + (" (STALE: the box changed since it was measured; `rtxserve capacity --record` again)"
                         if h["stale"] else ""))
        for line in [*_keeper(run), *_promotions(run)]:
            print("  " + line)
    return 0 if all(s["alive"] and s["ready"] == "200" for rows in servers.values() for s in rows) else 1


def _keeper(run: Path) -> list[str]:
    """Whether a dead server is started again, and what the keeper last failed to start."""
    state = read_state(run)
    keeper = keeper_alive(state.get("keeper"))
    lines = [f"keeper: pid {keeper.pid}, a server that dies is started again" if keeper else
             "keeper: none (--restart no): a server that dies stays down" if state.get("up", {}).get("restart") == "no"
             else "keeper: NOT RUNNING: `rtxserve serve up` of the same file starts it again"]
    lines += [f"{name}: last start failed: {c['last_error']}" for name, c in restarts(run).items() if c.get("last_error")]
    return lines


def _promotions(run: Path) -> list[str]:
    """What promotions made of the box (its rollout file): each name they moved, what they retired, what runs."""
    snapshot = promoted(run)
    lines = [f"promoted: {name} -> " + ", ".join(f"{t} ({w} %)" for t, w in route.targets.items())
             for name, route in snapshot.routes.items()]
    if snapshot.retired:
        lines.append(f"retired by promotions: {', '.join(snapshot.retired)}")
    lines += [f"promotion {p.id} of {p.model} running: {p.current} -> {p.candidate}, {p.phase}"
              + (f" at {p.weight} %" if p.phase == "canary" else "") for p in snapshot.promotions.values()]
    return lines


def _down(args) -> int:
    try:
        left = down(_run_of(args), grace_s=args.grace, log=lambda m: print(m, file=sys.stderr))
    except (DeploymentError, OSError) as exc:
        print(f"rtxserve serve down: error: {exc}", file=sys.stderr)
        return 3
    if left:
        print(f"rtxserve serve down: error: still running: {', '.join(left)}", file=sys.stderr)
        return 1
    print("stopped", file=sys.stderr)
    return 0


def add_commands(sub) -> None:
    state_help = ("where each deployment's run folder goes, the same for every working directory (default "
                  "RTXSERVE_STATE_DIR, else $XDG_STATE_HOME/rtxserve, else ~/.local/state/rtxserve)")
    u = sub.add_parser("up", help="bring a whole box up from its deployment file (Triton, vLLM engines, gateway)")
    u.add_argument("deployment", type=Path, help="the deployment file (YAML)")
    u.add_argument("--state-dir", "--run-root", dest="state_dir", type=Path, help=state_help)
    u.add_argument("--triton-env", type=Path, default=env_dir(TRITON))
    u.add_argument("--vllm-env", type=Path, default=env_dir(VLLM))
    u.add_argument("--start-timeout", type=float, default=600.0, help="seconds each server has to become ready")
    u.add_argument("--tritonserver", type=Path, help="a tritonserver with the native GPU backends (the NGC image's "
                   "/opt/tritonserver/bin/tritonserver): needed for GPU entries")
    u.add_argument("--backend-directory", type=Path, help="that tritonserver's backends (default /opt/tritonserver/backends)")
    u.add_argument("--restart", choices=RESTART_POLICIES, default="on-failure", help="on-failure: a keeper process "
                   "starts a server that dies again, alone, with backoff (10 s doubling to 5 min while it keeps dying; "
                   "counted in `serve status` and the gateway's /metrics); no: it stays down")
    u.add_argument("--verify", action="store_true", help="then hold every model to its reference set through the "
                   "gateway (`rtxserve eval`); exit 1 where one does not answer as it was trained")
    u.add_argument("--api-key", default=os.environ.get("RTXSERVE_API_KEY", ""), help="--verify: a gateway key that may "
                   "use every model (env RTXSERVE_API_KEY), where the box has keys")
    u.set_defaults(run=_up)
    for name, fn, text in (("status", _status, "what a deployment runs and whether each server answers ready"),
                           ("down", _down, "stop a deployment's servers (gateway first), leaving no process behind")):
        c = sub.add_parser(name, help=text)
        c.add_argument("target", nargs="?" if name == "status" else None,
                       help="the deployment's name, its file, or its run folder" + (
                           " (default: every deployment that runs)" if name == "status" else ""))
        c.add_argument("--state-dir", "--run-root", dest="state_dir", type=Path, help=state_help)
        if name == "down":
            c.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
        c.set_defaults(run=fn)

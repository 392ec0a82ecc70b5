"""`rtxserve plan DEPLOYMENT`: the GPU memory plan; `rtxserve deploy render|bundle DEPLOYMENT`; `rtxserve adapters
add|remove`: LoRA adapters loaded into a running deployment (deploy/adapters.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plan_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtxserve plan", description="What each GPU of a deployment holds, "
                                     "estimated from its artifacts; exit 2 when it does not fit.")
    parser.add_argument("deployment", type=Path)
    parser.add_argument("--json", action="store_true", help="the plan as JSON on stdout")
    parser.add_argument("--measure", action="store_true", help="the deployment is running (`rtxserve serve up`): "
                        "set each server's GPU memory, measured by NVML, beside the plan")
    parser.add_argument("--state-dir", "--run-root", dest="state_dir", type=Path,
                        help="where `serve up` keeps its runs (default: its per-user state directory)")
    args = parser.parse_args(argv)
    from .plan import format_plan, plan
    from .spec import DeploymentError
    from .load import load_deployment

    try:
        deployment = load_deployment(args.deployment)
        p = plan(deployment)
    except (DeploymentError, OSError) as exc:
        print(f"rtxserve plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_json(), indent=2) if args.json else format_plan(p))
    if args.measure:
        from deploy.box_state import run_dir

        from .measure import format_measured, measure

        try:
            print("\n" + format_measured(measure(p, run_dir(deployment.name, args.state_dir))))
        except (DeploymentError, RuntimeError, OSError) as exc:
            print(f"rtxserve plan --measure: error: {exc}", file=sys.stderr)
            return 2
    return 0 if p.fits else 2


def adapters_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtxserve adapters", description="Load a LoRA adapter into a running "
                                     "deployment's engines, or unload one, without a restart; the deployment file is "
                                     "updated so that `serve up` brings the same set back.")
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="check an adapter against its base, load it on every replica, write it in")
    add.add_argument("name", help="the model name clients will call it by")
    add.add_argument("path", type=Path, help="the PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    add.add_argument("--base", help="the LLM entry it adapts (default: the deployment's only LLM)")
    remove = sub.add_parser("remove", help="unload an adapter from every replica and take it out of the file")
    remove.add_argument("name")
    for p in (add, remove):
        p.add_argument("--deployment", type=Path, default=Path("deployment.yaml"),
                       help="the running deployment's file (default: ./deployment.yaml)")
    args = parser.parse_args(argv)
    from .adapters import add_adapter, remove_adapter
    from .spec import DeploymentError

    try:
        if args.command == "add":
            m = add_adapter(args.deployment, args.name, args.path, args.base)
            print(f"{args.name} loaded on every engine of {m.name}, and written into {args.deployment}")
        else:
            m = remove_adapter(args.deployment, args.name)
            print(f"{args.name} unloaded from every engine of {m.name}, and taken out of {args.deployment}")
    except (DeploymentError, OSError) as exc:
        print(f"rtxserve adapters {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtxserve deploy", description="The files a box or a fleet runs, for a deployment.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="compose, systemd units, Kubernetes (kustomize), Prometheus and Grafana files")
    r.add_argument("deployment", type=Path)
    r.add_argument("--out", type=Path, required=True, help="folder to write (artifacts are hard-linked into OUT/models)")
    r.add_argument("--prefix", type=Path, help="where rtxserve is installed on the box, for the systemd units "
                   "(default: this folder)")
    r.add_argument("--at", type=Path, help="where OUT will be on the box, for the systemd units (default: OUT)")
    r.add_argument("--tritonserver", type=Path, help="systemd: run this tritonserver binary (e.g. a native install "
                   "with the onnxruntime and tensorrt backends) instead of the one in PREFIX/.envs/triton")
    r.add_argument("--backend-directory", type=Path, help="systemd: that tritonserver's backends")
    b = sub.add_parser("bundle", help="one archive that installs and runs the deployment with no network")
    b.add_argument("deployment", type=Path)
    b.add_argument("--out", type=Path, required=True, help="the archive to write (.tar)")
    b.add_argument("--prefix", type=Path, help="where the box unpacks it (default /opt/rtxserve-NAME): the systemd units' paths")
    b.add_argument("--wheels-cache", type=Path, default=Path(".rtxserve/wheels"), help="wheels kept between bundles")
    args = parser.parse_args(argv)
    from .render import render
    from .spec import DeploymentError
    from .load import load_deployment

    if args.command == "bundle":
        import subprocess

        from .bundle import bundle

        try:
            out = bundle(load_deployment(args.deployment), args.out, prefix=args.prefix, cache=args.wheels_cache.resolve(),
                         log=lambda m: print(m, file=sys.stderr))
        except (DeploymentError, OSError) as exc:
            print(f"rtxserve deploy bundle: error: {exc}", file=sys.stderr)
            return 2
        except subprocess.CalledProcessError as exc:
            print(f"rtxserve deploy bundle: error: {' '.join(exc.cmd[:6])} ... failed (exit {exc.returncode})", file=sys.stderr)
            return 1
        print(f"{out} ({out.stat().st_size / 1e6:.0f} MB): copy it to the box, `tar xf` it where --prefix says, run install.sh",
              file=sys.stderr)
        return 0
    try:
        written = render(load_deployment(args.deployment), args.out, at=args.at, prefix=args.prefix,
                         tritonserver=args.tritonserver, backend_directory=args.backend_directory)
    except (DeploymentError, OSError) as exc:
        print(f"rtxserve deploy render: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.out}: compose/, systemd/, kubernetes/, monitoring/, images.txt", file=sys.stderr)
    skipped = args.out / "systemd" / "README"
    if skipped in written:
        print(f"rtxserve deploy render: systemd/: {skipped.read_text().strip()}", file=sys.stderr)
    return 0

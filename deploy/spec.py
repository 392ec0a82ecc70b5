"""The deployment file: one YAML document that says what a box (or a fleet) runs.

    name: demo
    gpus: {count: 1, memory_gib: 23.6}      # count 0: the embedded CPU default
    ports: {gateway: 8080}                  # the others have defaults
    gateway: {workers: 2, keys_file: keys.yaml, settings: {max_tokens: 2048}}
    models:
      - {name: sentiment, kind: encoder, path: model_repository/sentiment, instances: 4, slo: "e2el:100"}
      - {name: llama, kind: llm, path: llm/merged, adapters: {support: llm/support}, replicas: 1,
         max_model_len: 4096, max_num_seqs: 16}

Everything here is checked on load (deploy/load.py's `load_deployment`), and each error names the field it is about
(`models[1].replicas: ...`). Paths are relative to the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core import contract
from core.tasks import DIFFUSION, ENCODER, LLM, SPEECH
from serve.gateway.settings import open_door

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")  # a DNS label: compose project, k8s names, unit names
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class DeploymentError(ValueError):
    """The deployment file, or what it points at, cannot be deployed as written."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GPUs(_Strict):
    count: int = Field(0, ge=0, le=16, description="GPUs on the box; 0: CPU only (the embedded default)")
    memory_gib: float = Field(23.6, gt=0, le=1024, description="memory of each GPU that CUDA can hand out, GiB: "
                              "an RTX 4090's 24 GiB less what the driver keeps (about 23.6; less with a display on it)")
    total_gib: float = Field(23.64, gt=0, le=1024, description="each GPU's total memory as the CUDA runtime reports it "
                             "(torch.cuda.mem_get_info's total: 23.64 GiB on an RTX 4090 under Linux, where nvidia-smi "
                             "says 24564 MiB): vLLM's --gpu-memory-utilization is a share of this")
    name: str = Field("NVIDIA GeForce RTX 4090", description="for the reports only")

    @model_validator(mode="after")
    def _total_holds_the_usable(self):
        if self.total_gib < self.memory_gib:
            raise ValueError(f"total_gib {self.total_gib:g} is below memory_gib {self.memory_gib:g}: total_gib is the "
                             "card's whole memory as the CUDA runtime reports it (torch.cuda.mem_get_info), memory_gib "
                             "what CUDA hands out")
        return self


class Ports(_Strict):
    gateway: int = Field(contract.GATEWAY_PORT, ge=1, le=65535)
    triton_http: int = Field(contract.TRITON_HTTP_PORT, ge=1, le=65535)
    triton_grpc: int = Field(contract.TRITON_GRPC_PORT, ge=1, le=65535)
    triton_metrics: int = Field(contract.TRITON_METRICS_PORT, ge=1, le=65535)
    vllm: int = Field(contract.VLLM_PORT, ge=1, le=65535, description="the first vLLM engine's port; engine i listens on vllm + i")
    store: int = Field(5433, ge=1, le=65535, description="the box's own PostgreSQL (store.server) under systemd, on "
                       "127.0.0.1 (not 5432: where Debian's postgresql package starts a cluster of its own); in "
                       "compose it is reached on the engines' network")


# The gateway settings that the deployment itself decides (ports, backend addresses, workers, keys).
_WIRED = {"host", "port", "workers", "triton_grpc_url", "vllm_url", "keys_file", "required_models", "batch_dir",
          "batch_store_url", "batch_store_password_file"}


class Gateway(_Strict):
    host: str = Field("127.0.0.1", description="bind address; beyond loopback a keys_file is required")
    workers: int = Field(1, ge=1, le=64)
    keys_file: Path | None = Field(None, description="API keys file (`rtxserve keys create`)")
    settings: dict = Field(default_factory=dict, description="any other gateway setting (limits, timeouts, "
                           "bounds), by its RTXSERVE_ name in lower case: see serve/gateway/settings.py")

    @field_validator("settings")
    @classmethod
    def _known_settings(cls, value: dict) -> dict:
        from serve.gateway.settings import GatewaySettings

        wired = sorted(set(value) & _WIRED)
        if wired:
            raise ValueError(f"{', '.join(wired)} come from the deployment itself (ports, gateway.host/workers/"
                             "keys_file, store, the models), not from gateway.settings")
        try:  # model_validate: the fields alone, not this machine's RTXSERVE_* environment
            GatewaySettings.model_validate({**value, "triton_grpc_url": "", "vllm_url": ""})
        except ValidationError as exc:
            raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
        return value


class Store(_Strict):
    """Where the gateways keep the Files and Batch APIs' files and state."""

    url: str = Field("", description="an existing PostgreSQL server every gateway reaches, "
                     "postgresql://USER@HOST:PORT/DATABASE (its password in password_file, never in the URL); empty: "
                     "SQLite in the box's own state (serve up, compose, systemd), and on Kubernetes a PostgreSQL "
                     "StatefulSet the render makes, its password made and kept in a Secret")
    password_file: Path | None = Field(None, description="a file holding url's password (its first line): given to the "
                                       "gateway as a secret (compose's, a systemd credential, Kubernetes'), never "
                                       "written into a manifest")
    storage: str = Field("10Gi", description="the rendered PostgreSQL StatefulSet's volume (Kubernetes, without url)")
    server: bool = Field(False, description="compose and systemd: run a PostgreSQL of the box's own (Debian's "
                         "package) that every gateway worker shares, for the Files and Batch APIs and the on-demand "
                         "decider, its password made at the first render and kept; `serve up` keeps SQLite, Kubernetes "
                         "renders a server of its own without url anyway")

    @field_validator("url")
    @classmethod
    def _postgresql(cls, value: str) -> str:
        if not value:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(value)
        except ArgumentError:
            raise ValueError(f"{value!r} is not a URL; give postgresql://USER@HOST:PORT/DATABASE") from None
        if url.get_backend_name() != "postgresql":
            raise ValueError(f"{url.drivername}:// is not PostgreSQL; give postgresql://USER@HOST:PORT/DATABASE "
                             "(without url: SQLite on a box)")
        if url.password is not None:
            raise ValueError("holds a password: put it in store.password_file (a file the render keeps out of every "
                             "manifest) and give the URL without it")
        if not (url.username and url.host and url.database):
            raise ValueError("name the user, the host and the database: postgresql://USER@HOST:PORT/DATABASE")
        return value

    @model_validator(mode="after")
    def _password_with_url(self) -> "Store":
        if self.password_file is not None and not self.url:
            raise ValueError("password_file: give url too (the server it is the password of)")
        if self.server and self.url:
            raise ValueError("server: the box runs a PostgreSQL of its own, or the gateways use url's: give one of them")
        return self

    @property
    def box_password(self) -> bool:
        """compose's and systemd's gateways read a store password: password_file's, or the box's own server's."""
        return self.password_file is not None or self.server


class Kubernetes(_Strict):
    """What the rendered kustomize base needs to know about the cluster."""

    registry: str = Field("", description="where the cluster pulls the images built here (rtxserve-triton, "
                          "rtxserve-gateway, and rtxserve-vllm-audio for speech models) from, e.g. "
                          "registry.example.com/ml (push them there); empty: their local "
                          "names, for a one-node cluster that imported them (k3s ctr images import, kind load)")
    storage_class: str | None = Field(None, description="the models claim's storage class (default: the cluster's default)")
    models_access_mode: Literal["ReadWriteOnce", "ReadOnlyMany"] = Field(
        "ReadWriteOnce", description="ReadWriteOnce: the pods on one node (what k3s' and kind's default provisioners "
        "make); ReadOnlyMany: pods on several nodes, where the storage class provides it")
    runtime_class: str | None = Field(None, description="runtimeClassName of the GPU pods, where nvidia is not the "
                                      "container runtime's default (e.g. nvidia)")
    gpu_device_class: str = Field("gpu.nvidia.com", description="the Dynamic Resource Allocation DeviceClass each GPU pod "
                                  "claims one whole GPU of (NVIDIA's DRA driver's gpu.nvidia.com; Kubernetes 1.34+)")
    monitoring_labels: dict[str, str] = Field(default_factory=lambda: {"release": "kube-prometheus-stack"},
                                              description="labels Prometheus selects ServiceMonitors and rules by "
                                              "(kube-prometheus-stack: release: <its Helm release>)")
    monitoring_namespace: str = Field("monitoring", description="the namespace Prometheus scrapes from: the engines' "
                                      "NetworkPolicies admit it")


class _Model(_Strict):
    name: str = Field(description="the name clients use in requests")
    path: Path = Field(description="the artifact, relative to the deployment file")
    slo: str | None = Field(None, description='what a request must meet, as `rtxserve loadtest --slo` takes it, e.g. "e2el:200"')
    resident: Literal["always", "on-demand"] = Field(
        "always", description="always: loaded when its server starts, and stays; on-demand: loaded by the gateway on "
        "its first request, unloaded when idle (idle_unload_s) or when another on-demand model needs the room (the "
        "least recently used first; never one serving a request). `rtxserve plan` shows the swap room they share")
    idle_unload_s: float | None = Field(None, gt=0, description="on-demand models: unloaded after this many seconds "
                                        "without a request (default: only to make room)")

    @model_validator(mode="after")
    def _idle_is_on_demand(self):
        if self.idle_unload_s is not None and self.resident != "on-demand":
            raise ValueError("idle_unload_s: applies to resident: on-demand models")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not MODEL_NAME.match(value):
            raise ValueError(f"{value!r}: use letters, digits, '.', '_' or '-' (128 at most), starting with a letter or digit")
        return value

    @field_validator("slo")
    @classmethod
    def _slo(cls, value: str | None) -> str | None:
        if value is not None:
            from core.slo import parse_slo

            parse_slo(value)  # ValueError says what is wrong
        return value


class EncoderModel(_Model):
    """An entry exported by `rtxserve export onnx` (classifier, NER tagger, embedder, vision): run by Triton."""

    kind: Literal[ENCODER]
    instances: int | Literal["auto"] = Field(1, description='Triton instances on each GPU (or on the CPU); "auto": '
                                              "as many as fit beside everything else")
    max_batch_size: int | None = Field(None, ge=1, le=contract.MAX_BATCH_SIZE, description="default: the export's")
    tensorrt: bool = Field(False, description="GPU only: serve the entry's ONNX graph as a TensorRT plan, built on "
                           "the box by the TensorRT release of the Triton image (deploy/engines.py)")
    response_cache_mb: int = Field(0, ge=0, le=65536, description="answers kept for this entry, MB per gateway "
                                   "worker: an input seen before is answered by the gateway without a call to Triton "
                                   "(classify, NER and embeddings are deterministic; serve/gateway/fleet/answer_cache.py). 0: off")
    triton_response_cache: bool = Field(False, description="also Triton's own response cache for the entry, of "
                                        "response_cache_mb: for several gateways in front of one Triton. The gateway "
                                        "then sends the entry's requests one by one (Triton's cache looks a call up "
                                        "whole), not coalesced")

    @field_validator("instances")
    @classmethod
    def _instances(cls, value):
        if value != "auto" and not 1 <= value <= 64:
            raise ValueError("use 1..64 or \"auto\"")
        return value

    @model_validator(mode="after")
    def _triton_cache_sized(self):
        if self.triton_response_cache and not self.response_cache_mb:
            raise ValueError("triton_response_cache needs response_cache_mb, the size of its cache")
        return self


class DiffusionModel(EncoderModel):
    """An entry exported by `rtxserve export diffusion` (a Stable Diffusion pipeline, its LoRA): run by Triton
    beside the encoders, one pipeline per instance."""

    kind: Literal[DIFFUSION]  # type: ignore[assignment]
    size: int | None = Field(None, ge=64, le=4096, description="the resolution planned for (default: the export's)")
    max_images: int = Field(1, ge=1, le=64, description="images one request makes at most (the gateway's max_images)")

    @field_validator("tensorrt")
    @classmethod
    def _no_tensorrt(cls, value: bool) -> bool:
        if value:
            raise ValueError("diffusion entries run their pipeline in PyTorch; tensorrt applies to encoders")
        return value

    @field_validator("response_cache_mb")
    @classmethod
    def _no_cache(cls, value: int) -> int:
        if value:
            raise ValueError("images are not cached (a request without a seed asks for a new one); "
                             "response_cache_mb applies to encoders")
        return value


class LLMModel(_Model):
    """A Hugging Face LLM folder (a full fine-tune, a merged LoRA, or a base with adapters): run by vLLM,
    one engine per replica, each replica on a GPU of its own (engines of different models may share one, each with
    its planned share; on a CPU box, several engines share the cores)."""

    kind: Literal[LLM]
    adapters: dict[str, Path] = Field(default_factory=dict, description="LoRA adapters served beside the model: name -> folder")
    replicas: int = Field(1, ge=1, le=16, description="vLLM engines, one per GPU")
    max_model_len: int | None = Field(None, ge=16, description="context length; default: the model's")
    max_num_seqs: int = Field(16, ge=1, le=1024, description="sequences an engine runs at once (its KV cache is sized for them)")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="tokens per engine step; default: vLLM's")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    kv_cache_gib: float = Field(contract.CPU_KV_CACHE_GIB, gt=0, le=512, description="CPU only: the KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
    tool_call_parser: str | None = None
    chat_template: Path | None = None
    max_images: int | None = Field(None, ge=0, le=64, description="vision-language models: images per prompt "
                                   "(vLLM's --limit-mm-per-prompt)")
    max_image_pixels: int | None = Field(None, ge=784, description="vision-language models: pixels an image is "
                                         "resized to at most (the processor's max_pixels)")
    vllm_args: list[str] = Field(default_factory=list, description="any other `vllm serve` option, as given")

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, value: dict) -> dict:
        for name in value:
            if not MODEL_NAME.match(name):
                raise ValueError(f"adapter name {name!r}: use letters, digits, '.', '_' or '-'")
        return value


class SpeechModel(LLMModel):
    """A Whisper folder (`rtxserve export speech`): run by vLLM as an LLM is (one engine per replica, each on a GPU
    of its own), served on /v1/audio/transcriptions and /v1/audio/translations. `max_model_len` bounds the
    transcript's tokens (default: the model's max_target_positions, 448 for Whisper)."""

    kind: Literal[SPEECH]  # type: ignore[assignment]

    @model_validator(mode="after")
    def _no_chat_options(self):
        given = [f for f in ("adapters", "tool_call_parser", "chat_template", "max_images", "max_image_pixels")
                 if getattr(self, f) not in (None, {})]
        if given:
            raise ValueError(f"{', '.join(given)}: chat options; a speech model takes none (a LoRA on a Whisper is "
                             "merged into it first)")
        return self


Model = Annotated[EncoderModel | DiffusionModel | LLMModel | SpeechModel, Field(discriminator="kind")]


class Deployment(_Strict):
    name: str = Field(description="a DNS label: lower case letters, digits and '-'")
    gpus: GPUs = Field(default_factory=GPUs)
    ports: Ports = Field(default_factory=Ports)
    gateway: Gateway = Field(default_factory=Gateway)
    kubernetes: Kubernetes = Field(default_factory=Kubernetes)
    store: Store = Field(default_factory=Store)
    models: list[Model] = Field(min_length=1)
    swap_room_gib: float | None = Field(None, gt=0, description="the memory the on-demand models share on each device, "
                                        "GiB (default: all that the always-resident models leave); `rtxserve plan` "
                                        "refuses a room the largest on-demand model does not fit in")
    base_dir: Path = Field(Path("."), exclude=True, description="where relative paths start: the file's folder")
    file: Path | None = Field(None, exclude=True, description="the deployment file it was read from, if any")

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if not NAME.match(value):
            raise ValueError(f"{value!r} is not a DNS label (lower case letters, digits and '-', 40 at most)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Deployment":
        seen: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for served in (m.name, *(m.adapters if isinstance(m, LLMModel) else ())):
                if served in seen:
                    raise ValueError(f"models[{i}]: the name {served!r} is already used by {seen[served]}")
                seen[served] = f"models[{i}]"
            if isinstance(m, LLMModel):
                limit = max(self.gpus.count, 1)
                if m.replicas > limit:
                    raise ValueError(f"models[{i}].replicas: {m.replicas} engines need {m.replicas} GPUs (one engine per GPU); "
                                     + (f"the box has {self.gpus.count}" if self.gpus.count else "a CPU deployment runs one"))
            if isinstance(m, EncoderModel) and m.tensorrt and not self.gpus.count:
                raise ValueError(f"models[{i}].tensorrt: TensorRT plans run on GPUs; this deployment has none (gpus.count 0)")
        names: dict[str, str] = {}
        for m in self.vllm_models:
            name = engine_name(m.name, m.replicas - 1)
            if len(name) > 63:
                raise ValueError(f"models.{m.name}: its engines would be named {name}, longer than the 63 characters "
                                 "a Kubernetes or compose name may have; use a shorter model name")
            if name in names:
                raise ValueError(f"models.{m.name}: its engines would have the same names as those of {names[name]} "
                                 f"({name}); rename one of them")
            names[name] = m.name
        ports: dict[int, str] = {}
        for port, what in self.port_list():
            if port in ports:
                raise ValueError(f"ports: {port} is used twice ({ports[port]} and {what})")
            if not 1 <= port <= 65535:
                raise ValueError(f"ports: {what} would be {port}, beyond 65535")
            ports[port] = what
        if open_door(self.gateway.host, self.gateway.keys_file):
            raise ValueError(f"gateway.keys_file: required when gateway.host is {self.gateway.host} (beyond loopback); "
                             "make keys with `rtxserve keys create`")
        return self

    @property
    def encoders(self) -> list[EncoderModel]:
        """Every model Triton serves: encoders and diffusion pipelines."""
        return [m for m in self.models if isinstance(m, EncoderModel)]

    @property
    def on_demand(self) -> list[EncoderModel | LLMModel]:
        """The models loaded when first asked for (resident: on-demand): Triton entries and vLLM engines."""
        return [m for m in self.models if m.resident == "on-demand"]

    @property
    def diffusion(self) -> list[DiffusionModel]:
        return [m for m in self.models if isinstance(m, DiffusionModel)]

    @property
    def vllm_models(self) -> list[LLMModel]:
        """Every model vLLM serves: LLMs and speech models."""
        return [m for m in self.models if isinstance(m, LLMModel)]

    @property
    def speech_models(self) -> list[str]:
        """The names of the speech models (their engines run vLLM's image with its audio packages added)."""
        return [m.name for m in self.models if m.kind == SPEECH]

    def engines(self) -> list[tuple[LLMModel, int, int]]:
        """Every vLLM engine: (model, replica index, port), in port order."""
        out, port = [], self.ports.vllm
        for m in self.vllm_models:
            for r in range(m.replicas):
                out.append((m, r, port))
                port += 1
        return out

    def port_list(self) -> list[tuple[int, str]]:
        """Every port the box listens on, with what listens there."""
        p = self.ports
        out = [(p.gateway, "ports.gateway")]
        if self.encoders:
            out += [(p.triton_http, "ports.triton_http"), (p.triton_grpc, "ports.triton_grpc"),
                    (p.triton_metrics, "ports.triton_metrics")]
        out += [(port, f"vLLM engine {m.name}#{r} (ports.vllm + {port - p.vllm})") for m, r, port in self.engines()]
        out += [(control_port(port), f"vLLM engine {m.name}#{r}'s sleep control (its port + {CONTROL_OFFSET})")
                for m, r, port in self.engines() if m.resident == "on-demand"]
        return out

    def resolve(self, path: Path) -> Path:
        return (self.base_dir / Path(path).expanduser()).resolve()  # an absolute path stays itself, links resolved

    @property
    def on_gpu(self) -> bool:
        return self.gpus.count > 0


CONTROL_OFFSET = 1000  # an on-demand CPU engine's sleep control (serve/engine_control.py) listens at its port + this


def control_port(engine_port: int) -> int:
    return engine_port + CONTROL_OFFSET


def llm_app(model: str) -> str:
    """The name an LLM's engines go by (compose services, Kubernetes Deployment and Service): a DNS label."""
    return f"vllm-{model.lower().replace('_', '-').replace('.', '-')}"


def engine_name(model: str, replica: int) -> str:
    """The server name of one engine of an LLM."""
    return f"{llm_app(model)}-{replica}"

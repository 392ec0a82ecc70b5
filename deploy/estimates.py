"""What each server of a deployment takes, estimated from its artifacts before anything starts (deploy/plan.py
packs them onto the GPUs, or holds them against the host).

Estimates, per instance:
- encoder (a Triton entry): its graph's weights as exported (fp32 / fp16 / int8 file), activations of one
  forward pass at the entry's max batch (an image graph's: its live tensors at its largest input, laid out by
  onnx-tool at export; a transformer's otherwise: the widest layer's live tensors and the attention scores at the
  max sequence, from the checkpoint's dimensions that export records), ONNX Runtime's arena rounding (x2), and a
  per-instance runtime share; plus, once per GPU, the Triton process (CUDA context, backends).
- LLM or speech model (a vLLM engine): weights from the safetensors headers in the serving dtype; the KV cache
  for `max_num_seqs` x `max_model_len` from layers, KV heads, head size and the KV dtype (a Whisper's decoder
  also caches its encoder states for cross-attention: max_source_positions more tokens per sequence); vLLM's profiling peak
  (one step of `max_num_batched_tokens` through the widest layer, and the sampler's logits); LoRA slots for
  every adapter at the padded rank on every linear layer; CUDA graphs and the CUDA context. The engine is
  then told its share: `--gpu-memory-utilization` = that sum less the CUDA context / the card's total memory as
  the CUDA runtime reports it (torch's mem_get_info: 23.64 GiB on a Linux 4090, not nvidia-smi's 23.99), so vLLM
  gives the KV cache what was planned and leaves the rest to Triton; its CUDA context sits beside its share (vLLM
  measures what it may take after the context exists), and is planned there. vLLM refuses to start when less than its share
  is free, so every target starts it after Triton has loaded (compose, systemd, Kubernetes' init container).

The constants below are first estimates; `rtxserve plan --measure` (on a GPU) prints the error against
what NVML measures per process.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from core.contract import SPEECH_RECOGNITION, TEXT_GENERATION
from core.entry_metadata import EntryMetadata
from core.tasks import DIFFUSION, ENCODER, SPEECH

from .spec import Deployment, DeploymentError, DiffusionModel, EncoderModel, LLMModel

from .load import encoder_metadata

GIB = 1024**3
TRITON_PROCESS_GIB = 0.75  # tritonserver on one GPU: CUDA context, cuBLAS/cuDNN handles, the CUDA memory pool
ENCODER_INSTANCE_GIB = 0.15  # one ONNX Runtime CUDA session: its stream, workspaces and arena's first chunk
ORT_ARENA_FACTOR = 2.0  # the arena grows in power-of-two chunks: up to twice the live bytes
VLLM_CONTEXT_GIB = 0.6  # CUDA context and non-torch allocations (cuBLAS workspaces) of one engine
VLLM_CUDA_GRAPHS_GIB = 0.5  # captured CUDA graphs at vLLM's default capture sizes
# vLLM's step budget when max_num_batched_tokens is not set: its API server's default by GPU size (arg_utils)
VLLM_DEFAULT_BATCHED_TOKENS = {"small": 2048, "large": 8192}  # below / from 70 GiB
CPU_ENCODER_INSTANCE_GIB = 0.35  # a python-backend stub with ONNX Runtime and NumPy loaded (RSS)
CPU_TRITON_GIB = 0.4
CPU_VLLM_PROCESS_GIB = 2.5  # the API server, engine core and worker processes with torch loaded (RSS)
CUDA_HOST_GIB = 1.0  # what CUDA's libraries and pinned staging buffers add to a GPU process's host memory
# A diffusion instance is a python-backend process of its own: its own CUDA context and PyTorch allocator.
DIFFUSION_PROCESS_GIB = 0.5  # on a GPU: CUDA context, cuBLAS / cuDNN workspaces
CPU_DIFFUSION_PROCESS_GIB = 0.4  # on CPU: the stub with torch and diffusers imported (RSS: 0.37 measured, tiny fixture)
# UNet activations, in values per latent pixel and channel of its first block and per image of a classifier-
# free-guidance pair: skip connections at every resolution and the working tensors, attention through PyTorch's
# SDPA (no score matrix kept). 300 gives about 1.5 GiB for SD-1.5 at 512x512 in fp16, the peak reported for
# diffusers with SDPA; not yet measured here (no GPU was lent).
UNET_ACTIVATION_VALUES = 300
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
SERVING_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Estimate:
    model: str
    kind: str  # one of core.tasks.KINDS
    gib: float  # one instance / one engine
    parts: dict[str, float]  # GiB by what it is for
    notes: list[str] = field(default_factory=list)
    kv_bytes_per_token: int = 0  # vLLM engines: what one token of KV cache takes
    context: int = 0  # vLLM engines: max_model_len (a Whisper's: plus its encoder states)
    task: str = ""  # Triton entries: the task export recorded (core.tasks), what the gateway routes it as


# ---------------------------------------------------------------------------------------------- encoders

def _entry_dimensions(meta: EntryMetadata) -> dict:
    dims = dict(meta.model_dimensions)
    if not dims and meta.source:  # entries exported before the dimensions were recorded: the checkpoint, if still there
        source = Path(meta.source) / "config.json"
        if source.is_file():
            config = json.loads(source.read_text())
            dims = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
    return dims


def _graph_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("1/*") if f.suffix in {".onnx", ".plan", ".data", ".bin"}
               or f.name.endswith(".onnx_data"))


def estimate_encoder(d: Deployment, m: EncoderModel) -> Estimate:
    meta = encoder_metadata(d, m)
    path = d.resolve(m.path)
    weights = _graph_bytes(path.parent / f"{m.name}_model") / GIB
    dims = _entry_dimensions(meta)
    notes = []
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    batch = m.max_batch_size or meta.max_batch_size or 1
    graph = meta.graph_activations
    if graph:  # the graph's own live tensors at its largest input (export/activations.py)
        live = graph["fixed_bytes"] + batch * graph["per_item_bytes"]
        activations = ORT_ARENA_FACTOR * live / GIB
        notes.append(f"activations from the graph's tensors at {'x'.join(map(str, graph['item_shape']))} per image")
    elif all(k in dims for k in needed):
        if "image_size" in dims and "patch_size" in dims:
            seq = (dims["image_size"] // dims["patch_size"]) ** 2 + 1
        else:
            seq = meta.max_length or dims.get("max_position_embeddings") or 512
        h, heads, inter = dims["hidden_size"], dims["num_attention_heads"], dims["intermediate_size"]
        act_bytes = 2 if meta.precision == "fp16" else 4
        live = batch * seq * (3 * h + inter) + 2 * batch * heads * seq * seq  # widest layer + scores and softmax
        activations = ORT_ARENA_FACTOR * live * act_bytes / GIB
    else:
        activations = weights  # nothing to size them from: assume as much again as the weights
        notes.append("no model dimensions or graph activations in rtxserve.json: activations assumed equal to weights "
                     "(export it again to record them)")
    overhead = ENCODER_INSTANCE_GIB if d.on_gpu else CPU_ENCODER_INSTANCE_GIB
    parts = {"weights": weights, "activations": activations, "runtime": overhead}
    notes.append(f"max batch {batch}")
    return Estimate(m.name, ENCODER, sum(parts.values()), parts, notes, task=meta.task)


def estimate_diffusion(d: Deployment, m: DiffusionModel) -> Estimate:
    """The pipeline's weights in the serving dtype (fp16 on a GPU, fp32 on CPU), the UNet's activations at the
    planned resolution for `max_images` images with classifier-free guidance, and the VAE decoding them."""
    from export.diffusion.stable_diffusion import component_weights
    from export.exceptions import ExportError

    meta = encoder_metadata(d, m)
    pipeline = d.resolve(m.path) / "1" / "pipeline"
    width = 2 if d.on_gpu else 4
    params = 0
    try:
        for component in ("unet", "vae", "text_encoder"):
            files = component_weights(pipeline / component)
            if not files:
                raise DeploymentError(f"models.{m.name}: {pipeline / component} has no weights")
            params += _header_sizes(files)[0]
        unet = json.loads((pipeline / "unet" / "config.json").read_text())
    except (OSError, ValueError, ExportError) as exc:
        raise DeploymentError(f"models.{m.name}: {pipeline} cannot be read ({exc})") from None
    except Exception as exc:  # safetensors' own error types for a damaged header
        raise DeploymentError(f"models.{m.name}: {pipeline} holds damaged safetensors ({exc})") from None
    size = m.size or meta.default_size or meta.native_size or 512
    latent = (size // (meta.vae_scale or 8)) ** 2
    channels = int((unet.get("block_out_channels") or [320])[0])
    activations = 2 * m.max_images * latent * channels * UNET_ACTIVATION_VALUES * width
    vae = m.max_images * size * size * 128 * width  # the decoder's widest feature map at full resolution
    parts = {"weights": params * width / GIB, "activations": (activations + vae) / GIB,
             "runtime": DIFFUSION_PROCESS_GIB if d.on_gpu else CPU_DIFFUSION_PROCESS_GIB}
    notes = [f"{params / 1e9:.2f} B parameters at {width} bytes", f"{m.max_images} image(s) of {size}x{size}"]
    return Estimate(m.name, DIFFUSION, sum(parts.values()), parts, notes, task=meta.task)


# ---------------------------------------------------------------------------------------------- LLMs

def _header_sizes(files: list[Path]) -> tuple[int, int]:
    """(parameters, stored bytes) from safetensors headers; no tensor is read."""
    from safetensors import safe_open

    params = stored = 0
    for file in files:
        with safe_open(file, "np") as f:
            for key in f.keys():
                s = f.get_slice(key)
                n = math.prod(s.get_shape())
                params += n
                stored += n * DTYPE_BYTES.get(s.get_dtype(), 4)
    return params, stored


def _serving_bytes(m: LLMModel, config: dict, on_gpu: bool) -> int:
    if m.dtype != "auto":
        return SERVING_BYTES[m.dtype]
    stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if not on_gpu:
        return 4 if m.adapters or stored == "float32" else 2  # serve/vllm_server.py serves adapters in float32 on CPU
    return 2  # vLLM's "auto" on a GPU: float16 for float32 / float16 checkpoints, bfloat16 for bfloat16 ones


@dataclass(frozen=True)
class _Geometry:
    """What the planner sizes a vLLM engine from, read from the model's config.json."""

    hidden: int
    layers: int  # the layers that keep a KV cache (a Whisper's decoder layers)
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    encoder_tokens: int = 0  # encoder-decoder models: the encoder states each sequence's cross-attention caches


def _geometry(config: dict, where: str) -> _Geometry:
    """A decoder (Llama-style names, as vLLM's supported decoder models write them) or a Whisper."""
    if config.get("model_type") == "whisper":
        names = ("d_model", "decoder_layers", "decoder_attention_heads", "max_source_positions", "max_target_positions")
        missing = [k for k in names if not isinstance(config.get(k), int)]
        if missing:
            raise DeploymentError(f"{where} has no {', '.join(missing)}: not a Whisper config as transformers writes it")
        h, heads = config["d_model"], config["decoder_attention_heads"]
        # vLLM caches, per decoder layer, the transcript's keys and values and the encoder states' (its
        # CrossAttentionSpec): 1500 positions for Whisper's 30 s window, max_source_positions in its config.
        return _Geometry(h, config["decoder_layers"], heads, heads, h // heads,
                         max(int(config.get("encoder_ffn_dim") or 4 * h), int(config.get("decoder_ffn_dim") or 4 * h)),
                         int(config.get("vocab_size") or 51866), encoder_tokens=config["max_source_positions"])
    config = config.get("text_config", config) if "num_hidden_layers" not in config else config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if not isinstance(config.get(k), int)]
    if missing:
        raise DeploymentError(f"{where} has no {', '.join(missing)}: the planner sizes Llama-style configs (those "
                              "names, as vLLM's supported decoder models write them) and Whisper's")
    h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return _Geometry(h, int(config["num_hidden_layers"]), heads, int(config.get("num_key_value_heads") or heads),
                     int(config.get("head_dim") or h // heads), int(config.get("intermediate_size") or 4 * h),
                     int(config.get("vocab_size") or 32000))


# The config keys vLLM reads a model's longest context from, the smallest present winning (model_max_length, where
# set, overriding them), as vLLM 0.32's derive_max_model_len_and_key does; and the RoPE types whose config already
# holds the scaled length (any other type's `factor` multiplies it), as its _get_and_verify_max_len does.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_limit(config: dict, tokenizer_config: dict | None = None) -> tuple[int, str]:
    """The longest max_model_len vLLM accepts for a model (without VLLM_ALLOW_LONG_MAX_MODEL_LEN), and what sets it:
    its config's length keys, its tokenizer's model_max_length, and a RoPE scaling factor. 2048 (vLLM's default)
    where the config names none."""
    text = config.get("text_config", config) if "num_hidden_layers" not in config else config
    found = {k: text[k] for k in _CONTEXT_KEYS if isinstance(text.get(k), (int, float)) and not isinstance(text[k], bool)}
    if isinstance(text.get("model_max_length"), int):
        key = "model_max_length"
    elif found:
        key = min(found, key=found.get)
    else:
        return 2048, "vLLM's default (the config names no length)"
    limit, why = float(found[key]), f"{key}={found[key]}"
    tokenizer_max = (tokenizer_config or {}).get("model_max_length")
    if isinstance(tokenizer_max, (int, float)) and tokenizer_max < limit:
        limit, why = float(tokenizer_max), f"the tokenizer's model_max_length={int(tokenizer_max)}"
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    # one set of parameters, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
    layers = [rope] if {"rope_type", "type", "factor"} & set(rope) else [v for v in rope.values() if isinstance(v, dict)]
    for params in layers:
        kind = params.get("rope_type") or params.get("type")
        if kind and kind not in _PRESCALED_ROPE and isinstance(params.get("factor"), (int, float)):
            return int(limit * params["factor"]), f"{why} x RoPE {kind} factor {params['factor']:g}"
    return int(limit), why


def _scheme(quantization: dict) -> str:
    """A checkpoint's quantisation in a few words: its method, and for compressed-tensors the weights' bits."""
    weights = [g.get("weights") or {} for g in (quantization.get("config_groups") or {}).values()]
    bits = sorted({f"{w.get('type', 'int')}{w.get('num_bits')}" for w in weights if w.get("num_bits")})
    return " ".join([str(quantization.get("quant_method", "?")), *bits])


def estimate_llm(d: Deployment, m: LLMModel) -> Estimate:
    """One vLLM engine of an LLM or a speech model."""
    from core.contract import padded_lora_rank

    path = d.resolve(m.path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DeploymentError(f"models.{m.name}: {path / 'config.json'} is not readable JSON ({exc})") from None
    g = _geometry(config, f"models.{m.name}: {path / 'config.json'}")
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer_config = None  # vLLM reads it where it is; a model without one is bounded by its config alone
    longest, why = context_limit(config, tokenizer_config)
    if m.max_model_len and m.max_model_len > longest:
        raise DeploymentError(f"models.{m.name}: max_model_len {m.max_model_len} is over the {longest} tokens the "
                              f"model allows ({why}, {path}); vLLM refuses to start it. Set max_model_len to "
                              f"{longest} or less, or leave it out")
    from serve.vllm_server import base_weights

    files = base_weights(path)
    if not files:
        raise DeploymentError(f"models.{m.name}: no safetensors weights in {path} to size it from")
    try:
        params, stored = _header_sizes(files)
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise DeploymentError(f"models.{m.name}: {files[0].parent} holds damaged safetensors ({exc})") from None
    quantized = "quantization_config" in config
    width = _serving_bytes(m, config, d.on_gpu)
    weights = (stored if quantized else params * width) / GIB
    context = m.max_model_len or longest
    kv_width = 1 if m.kv_cache_dtype == "fp8" else width
    kv_per_token = 2 * g.layers * g.kv_heads * g.head_dim * kv_width
    tokens_per_seq = context + g.encoder_tokens
    kv = kv_per_token * m.max_num_seqs * tokens_per_seq / GIB
    notes = [f"KV cache {kv_per_token / 1024:.0f} KiB/token x {m.max_num_seqs} seqs x "
             + (f"({context} tokens + {g.encoder_tokens} encoder states)" if g.encoder_tokens else f"{context} tokens"),
             f"quantised ({_scheme(config['quantization_config'])}): {stored / 1e9:.2f} GB as stored" if quantized
             else f"{params / 1e9:.2f} B parameters at {width} bytes"]
    parts = {"weights": weights}
    if d.on_gpu:
        tokens = m.max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS["large" if d.gpus.memory_gib >= 70 else "small"]
        parts["kv_cache"] = kv
        parts["activations"] = (tokens * (4 * g.hidden + 3 * g.intermediate) * width + 2 * m.max_num_seqs * g.vocab * 4) / GIB
        if m.adapters:
            ranks = [int(json.loads((d.resolve(a) / "adapter_config.json").read_text()).get("r", 8)) for a in m.adapters.values()]
            rank = padded_lora_rank(max(ranks))
            h, q, kv_out, inter = g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim, g.intermediate
            fans = (h + q) + 2 * (h + kv_out) + (q + h) + 2 * (h + inter) + (inter + h)  # q k v o gate up down
            parts["lora"] = len(m.adapters) * rank * fans * g.layers * width / GIB
            notes.append(f"{len(m.adapters)} LoRA slot(s) at rank {rank}")
        parts["cuda_graphs"] = VLLM_CUDA_GRAPHS_GIB
        parts["runtime"] = VLLM_CONTEXT_GIB
    else:
        parts["kv_cache"] = m.kv_cache_gib  # what VLLM_CPU_KVCACHE_SPACE reserves
        parts["runtime"] = CPU_VLLM_PROCESS_GIB
        if kv > m.kv_cache_gib:
            notes.append(f"kv_cache_gib {m.kv_cache_gib:g} holds {m.kv_cache_gib * GIB / kv_per_token:.0f} tokens, "
                         f"fewer than {m.max_num_seqs} x {tokens_per_seq}: vLLM queues the rest")
    task = SPEECH_RECOGNITION if m.kind == SPEECH else TEXT_GENERATION
    return Estimate(m.name, m.kind, sum(parts.values()), parts, notes, kv_per_token, tokens_per_seq, task)

"""Megatron-core checkpoints (Megatron-LM's `torch_dist` layout) -> a Hugging Face folder.

- Megatron's own distributed checkpointing reads the shards into a model with tensor and pipeline
  parallelism 1: the TP/PP shards are merged by `dist_checkpointing.load`, not by us.
- mbridge's mapping tables name each Hugging Face tensor and un-interleave the fused QKV and gate/up
  projections (`Bridge._weight_to_hf_format`). mbridge builds its models with Transformer Engine, which
  cannot run on CPU; the checkpoint's keys, written by the local layer spec, already carry TE's names
  (the spec's `sharded_state_dict_keys_map`), so only the model is built here, with the local spec.
- The parity reference is that Megatron GPTModel itself, loaded from the original shards.

Runs in-process on CPU in a one-rank gloo group.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import read_json
from ..exceptions import ExportError

log = logging.getLogger(__name__)

# Megatron-LM arguments -> the Hugging Face architecture mbridge maps them to.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "RMSNorm, SwiGLU, RoPE, no linear biases (Llama, Mistral-style)"),
    "qwen2": ("Qwen2ForCausalLM", "the same with QKV biases (Qwen2 / Qwen2.5)"),
}


@dataclass(frozen=True)
class MegatronCheckpoint:
    path: Path  # the iteration folder (iter_NNNNNNN or release)
    args: argparse.Namespace
    tp: int
    pp: int
    model_type: str
    iteration: int | None


def is_megatron(path: Path) -> bool:
    return ((path / "latest_checkpointed_iteration.txt").is_file() or (path / "metadata.json").is_file()
            and (path / ".metadata").is_file() or any(path.glob("mp_rank_*/model_optim_rng.pt")))


def _iteration_dir(path: Path) -> Path:
    tracker = path / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return path
    text = tracker.read_text().strip()
    folder = path / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else text)
    if not folder.is_dir():
        raise ExportError(f"{tracker} names iteration {text}, but {folder} does not exist")
    return folder


# Megatron-LM arguments that change the model in ways the Llama / Qwen2 mappings do not carry.
UNSUPPORTED = ("qk_layernorm", "apply_layernorm_1p", "use_rope_scaling", "multi_latent_attention", "num_experts",
               "add_bias_linear")


def _model_type(args: argparse.Namespace) -> str:
    on = [name for name in UNSUPPORTED if getattr(args, name, None)]
    if on:
        supported = "; ".join(f"{arch} ({what})" for arch, what in ARCHITECTURES.values())
        raise ExportError(f"the converter does not know this Megatron architecture ({', '.join(f'{n}=True' for n in on)} "
                          f"is not mapped); supported: {supported}")
    llama_like = (getattr(args, "normalization", "LayerNorm") == "RMSNorm" and getattr(args, "swiglu", False)
                  and getattr(args, "position_embedding_type", "") == "rope" and not getattr(args, "add_bias_linear", True)
                  and not getattr(args, "num_experts", None))
    if llama_like:
        return "qwen2" if getattr(args, "add_qkv_bias", False) else "llama"
    found = (f"normalization={getattr(args, 'normalization', None)}, swiglu={getattr(args, 'swiglu', None)}, "
             f"position_embedding_type={getattr(args, 'position_embedding_type', None)}, "
             f"add_bias_linear={getattr(args, 'add_bias_linear', None)}, num_experts={getattr(args, 'num_experts', None)}")
    supported = "; ".join(f"{arch} ({what})" for arch, what in ARCHITECTURES.values())
    raise ExportError(f"the converter does not know this Megatron architecture ({found}); supported: {supported}")


def _saved_tp(path: Path) -> int:
    """Tensor-parallel degree the shards were written with: the vocabulary-parallel embedding's row slices."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    embedding = meta.get("embedding.word_embeddings.weight") or meta.get("output_layer.weight")
    if embedding is None or not hasattr(embedding, "chunks"):
        raise ExportError(f"{path} holds no embedding or output layer: not a GPT checkpoint of Megatron-core")
    return len({chunk.offsets[0] for chunk in embedding.chunks})


def inspect_megatron(path: Path) -> MegatronCheckpoint:
    folder = _iteration_dir(path)
    legacy = sorted(p.parent.name for p in folder.glob("mp_rank_*/model_optim_rng.pt"))
    if legacy:
        raise ExportError(f"{folder} is a legacy Megatron checkpoint ({', '.join(legacy)}); save it again with "
                          "--ckpt-format torch_dist (Megatron-LM's tools/checkpoint/convert.py --saver mcore), then export that")
    meta = folder / "metadata.json"
    if not meta.is_file() or not (folder / ".metadata").is_file():
        raise ExportError(f"{folder} is not a Megatron torch_dist checkpoint: no metadata.json and .metadata")
    backend = read_json(meta, "Megatron checkpoint").get("sharded_backend")
    if backend != "torch_dist":
        raise ExportError(f"{folder} uses the {backend} backend; only torch_dist checkpoints are supported")
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(folder))
    args = common.get("args")
    if args is None:
        raise ExportError(f"{folder}/common.pt holds no training arguments ('args'): the model's shape is unknown")
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    saved = _saved_tp(folder)
    if saved != tp:
        raise ExportError(f"{folder}: the shards are split {saved} ways by tensor parallelism, but the checkpoint's "
                          f"arguments say tensor_model_parallel_size={tp}; the checkpoint is inconsistent")
    return MegatronCheckpoint(folder, args, tp, pp, _model_type(args), common.get("iteration"))


@contextlib.contextmanager
def _cpu_megatron() -> Iterator[None]:
    """A one-rank gloo group and the two CUDA calls Megatron-core makes with no CPU path (DESIGN.md)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    saved = torch.cuda.synchronize, torch.cuda.current_device
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.cuda.synchronize = lambda *a, **k: None
            torch.cuda.current_device = lambda: torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.cuda.synchronize, torch.cuda.current_device = saved


def hf_config(args: argparse.Namespace, model_type: str, tokenizer) -> dict:
    heads = args.num_attention_heads
    kv_heads = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    return {
        "architectures": [ARCHITECTURES[model_type][0]], "model_type": model_type,
        "hidden_size": args.hidden_size, "intermediate_size": args.ffn_hidden_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": getattr(args, "kv_channels", None) or args.hidden_size // heads,
        "rms_norm_eps": getattr(args, "norm_epsilon", 1e-5), "rope_theta": float(getattr(args, "rotary_base", 10000)),
        "max_position_embeddings": args.max_position_embeddings, "vocab_size": len(tokenizer),
        "tie_word_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
        "hidden_act": "silu", "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }


def _gpt_model(args: argparse.Namespace):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        kv_channels=getattr(args, "kv_channels", None), normalization="RMSNorm",
        layernorm_epsilon=getattr(args, "norm_epsilon", 1e-5), gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=getattr(args, "add_qkv_bias", False),
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
    )
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
                    position_embedding_type="rope", rotary_base=getattr(args, "rotary_base", 10000),
                    rotary_percent=getattr(args, "rotary_percent", 1.0)).eval()


def _logits(model, ids: list[list[int]], vocab: int) -> list[np.ndarray]:
    import torch

    out = []
    with torch.no_grad():
        for x in ids:
            n = len(x)
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)[None, None]
            logits = model(torch.tensor([x]), torch.arange(n)[None], attention_mask=mask)
            out.append(logits[..., :vocab].float().numpy())
    return out


def _model_keys_not_loaded(path: Path, requested: set[str]) -> list[str]:
    """Model tensors in the checkpoint that the model built from its arguments does not have (optimizer state, RNG
    state and layers' extra state are not model tensors): a sign of an architecture feature the arguments did not say."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sorted(k for k in saved if k.split("/")[0] not in requested and "_extra_state" not in k
                  and not k.startswith(("optimizer", "rng_state", "rerun_state")))


def convert(ckpt: MegatronCheckpoint, tokenizer_dir: Path, out: Path, ids: list[list[int]],
            dtype: str = "float32") -> list[np.ndarray]:
    """Write the Hugging Face model to `out` in `dtype`; return the Megatron model's logits on `ids` (the reference)."""
    import torch
    from mbridge.core.bridge import _MODEL_REGISTRY
    from mbridge.core.parallel_states import ParallelStates
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(**hf_config(ckpt.args, ckpt.model_type, tokenizer))
    vocab = len(tokenizer)
    if vocab > ckpt.args.padded_vocab_size:
        raise ExportError(f"the tokenizer in {tokenizer_dir} has {vocab} tokens, the checkpoint's vocabulary "
                          f"{ckpt.args.padded_vocab_size}: pass the tokenizer the model was trained with (--base)")
    with _cpu_megatron():
        model = _gpt_model(ckpt.args)
        sharded = model.sharded_state_dict()
        extra = _model_keys_not_loaded(ckpt.path, {v.key for v in sharded.values() if hasattr(v, "key")})
        if extra:
            raise ExportError(f"{ckpt.path} holds model tensors the converter would drop: {', '.join(extra[:5])}; "
                              "the architecture has features this converter does not map")
        try:
            state = dist_checkpointing.load({"model": sharded}, str(ckpt.path))
        except Exception as exc:
            raise ExportError(f"Megatron could not load {ckpt.path} ({type(exc).__name__}: {exc})") from exc
        missing, unexpected = model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if "_extra_state" not in k]
        if missing or unexpected:
            raise ExportError(f"{ckpt.path} does not fit the model its arguments describe: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
        reference = _logits(model, ids, vocab)
        # Parameter names as the checkpoint writes them (TE's), through the local spec's own key map.
        keys_map = model.decoder.layers[0].submodules_config.sharded_state_dict_keys_map
        bridge = _MODEL_REGISTRY[ckpt.model_type](config, dtype=torch.float32, parallel_states=ParallelStates(),
                                                  make_vocab_size_divisible_by=ckpt.args.make_vocab_size_divisible_by
                                                  if hasattr(ckpt.args, "make_vocab_size_divisible_by") else None)
        bridge.vocab_size, bridge.padded_vocab_size = vocab, ckpt.args.padded_vocab_size
        hf_state = {}
        for name, tensor in model.state_dict().items():
            if "_extra_state" in name or name.endswith("rotary_pos_emb.inv_freq"):
                continue
            for local, te in keys_map.items():
                name = name.replace(f".{local}", f".{te}")
            names, tensors = bridge._weight_to_hf_format(name, tensor)
            hf_state.update(zip(names, (t[:vocab] if t.shape[0] == ckpt.args.padded_vocab_size else t for t in tensors)))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    if config.tie_word_embeddings:  # Megatron's default: the output layer is the embedding, and not saved apart
        hf.tie_weights()
        missing = [k for k in missing if k not in set(hf._tied_weights_keys or {})]
    if missing or unexpected:
        raise ExportError(f"mbridge's mapping left {ckpt.model_type} weights unmatched: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    hf.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return reference


def tokenizer_folder(ckpt: MegatronCheckpoint, given: Path | None) -> Path:
    """The tokenizer: --base if given, else the Hugging Face tokenizer the training arguments name."""
    if given is not None:
        return given
    recorded = getattr(ckpt.args, "tokenizer_model", None)
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    raise ExportError(f"{ckpt.path}: the training arguments name tokenizer {recorded!r}, which is not a local "
                      "Hugging Face tokenizer folder; pass the tokenizer folder with --base PATH")

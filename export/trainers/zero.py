"""DeepSpeed ZeRO checkpoints (`global_stepN/` shards, as written without 16-bit gathering) -> a Hugging Face
folder, consolidated by DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`.

The parity reference is the trainer's own model: DeepSpeed's engine loads the original shards at the world
size that wrote them (torchrun, gloo on CPU; export/trainers/zero_reference.py) and runs the sample prompts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import TOKENIZER_FILES
from ..exceptions import ExportError

log = logging.getLogger(__name__)
# The folder that holds the export package: torchrun's ranks import export.trainers.zero_reference from it.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ZeroCheckpoint:
    path: Path  # the folder holding `latest` / global_stepN
    tag: str  # global_stepN
    world_size: int
    stage: int

    @property
    def shards(self) -> Path:
        return self.path / self.tag


def is_zero(path: Path) -> bool:
    return (path / "latest").is_file() or any(path.glob("global_step*/*model_states.pt"))


def _tag(path: Path) -> str:
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (path / tag).is_dir():
            raise ExportError(f"{latest} names {tag}, but {path / tag} does not exist")
        return tag
    tags = sorted((p.name for p in path.glob("global_step*") if p.is_dir()), key=lambda t: int(re.sub(r"\D", "", t) or 0))
    return tags[-1]


def inspect_zero(path: Path) -> ZeroCheckpoint:
    """The checkpoint's tag, world size and ZeRO stage; every rank's model and optimizer shard must be there."""
    import torch

    tag = _tag(path)
    shards = path / tag
    model_files = sorted(shards.glob("*model_states.pt"))
    if not model_files:
        raise ExportError(f"{shards} holds no *_model_states.pt: not a DeepSpeed checkpoint")
    try:
        states = torch.load(model_files[0], map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign pickle
        raise ExportError(f"cannot read {model_files[0]} ({type(exc).__name__}: {exc}); the checkpoint is damaged") from exc
    world = int(states.get("dp_world_size") or 1)
    mp = int(states.get("mp_world_size") or 1)
    stage = int((states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    if stage == 0:
        raise ExportError(f"{shards} is a DeepSpeed checkpoint without ZeRO partitions (stage 0): its model is whole in "
                          f"{model_files[0].name}; load it with DeepSpeed or torch.load and save_pretrained it")
    if mp != 1:
        raise ExportError(f"{shards} was written with model parallelism {mp}; only data-parallel ZeRO checkpoints "
                          "(mp_rank_00) are supported")
    # Every rank writes its optimizer partition; under ZeRO-3 each also writes its model states.
    names = set(os.listdir(shards))
    bf16 = "bf16_" if any(n.startswith("bf16_") for n in names) else ""
    expected = [f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    if stage == 3:
        expected += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    missing = sorted(n for n in expected if n not in names)
    if missing:
        raise ExportError(f"{shards} was written by {world} ranks but is missing rank files: {', '.join(missing)}; "
                          "copy the whole global_step folder")
    return ZeroCheckpoint(path, tag, world, stage)


def config_folder(ckpt: ZeroCheckpoint, base: Path | None) -> Path:
    """Where the model's config is: beside the shards (the Trainer writes it), else --base."""
    folder = ckpt.path if (ckpt.path / "config.json").is_file() else base
    if folder is None or not (folder / "config.json").is_file():
        raise ExportError(f"{ckpt.path} holds ZeRO shards but no config.json; pass the model's Hugging Face folder "
                          "(config and tokenizer) with --base PATH")
    return folder


def tokenizer_folder(config_dir: Path, base: Path | None) -> Path:
    """--base when it holds a tokenizer (it wins over the one beside the shards), else the config's folder."""
    if base is not None and any((base / n).is_file() for n in TOKENIZER_FILES):
        return base
    if not any((config_dir / n).is_file() for n in TOKENIZER_FILES):
        raise ExportError(f"no tokenizer in {config_dir}" + (f" or {base}" if base else "")
                          + "; pass a folder with the model's tokenizer with --base PATH")
    return config_dir


def consolidate(ckpt: ZeroCheckpoint, config_dir: Path, out: Path, auto_class: str, dtype: str) -> None:
    """DeepSpeed's own consolidation into fp32 weights, saved in `dtype` as a safetensors Hugging Face model in `out`."""
    import torch
    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig

    try:
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.path), tag=ckpt.tag)
    except Exception as exc:
        raise ExportError(f"DeepSpeed could not consolidate {ckpt.shards} ({type(exc).__name__}: {exc})") from exc
    config = AutoConfig.from_pretrained(config_dir)
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) if config.tie_word_embeddings else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ExportError(f"the ZeRO weights in {ckpt.shards} do not fit {config_dir / 'config.json'}: "
                          f"missing {', '.join(missing[:5]) or 'none'}; unexpected {', '.join(unexpected[:5]) or 'none'}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)


def reference_logits(ckpt: ZeroCheckpoint, config_dir: Path, ids: list[list[int]], work: Path, auto_class: str,
                     timeout_s: float = 3600) -> tuple[list[np.ndarray], str]:
    """Outputs of DeepSpeed's engine loaded from the original shards, and the command that produced them."""
    ids_file, logits_file = work / "parity-ids.json", work / "zero-reference.npz"
    ids_file.write_text(json.dumps(ids))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ckpt.world_size}",
            "-m", "export.trainers.zero_reference", str(ckpt.path), ckpt.tag, str(config_dir), str(ids_file), str(logits_file),
            auto_class, str(ckpt.stage)]
    log.info("    %s", shlex.join(argv))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT),
                                                       os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ExportError(f"DeepSpeed's engine did not load {ckpt.shards} within {timeout_s:.0f} s for the parity "
                          f"check; rerun it by hand to see where it waits: {shlex.join(argv)}") from None
    if done.returncode != 0 or not logits_file.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise ExportError(f"DeepSpeed's engine could not load {ckpt.shards} for the parity check:\n{tail}")
    with np.load(logits_file) as data:
        return [data[f"p{i}"] for i in range(len(ids))], shlex.join(argv)


def origin(ckpt: ZeroCheckpoint) -> dict:
    return {"format": f"deepspeed-zero{ckpt.stage}", "tag": ckpt.tag, "world_size": ckpt.world_size}


def reference_name(ckpt: ZeroCheckpoint) -> str:
    return f"DeepSpeed ZeRO-{ckpt.stage} engine, world size {ckpt.world_size}, from {ckpt.shards}"


def to_hugging_face(ckpt: ZeroCheckpoint, config_dir: Path, work: Path, *, auto_class: str, ids: list[list[int]],
                    dtype: str, atol: float, allow_drift: bool, steps=log.info, output: str = "logits") -> tuple[Path, dict]:
    """The checkpoint as a Hugging Face folder in `work`, checked against DeepSpeed's engine on `ids`: the folder and
    the figures for parity.json (ParityError beyond `atol` unless drift is allowed)."""
    from ..parity import compare_with_trainer

    hf = work / "hf"
    steps("consolidating %d ranks' ZeRO-%d shards (%s) with DeepSpeed's get_fp32_state_dict_from_zero_checkpoint",
          ckpt.world_size, ckpt.stage, ckpt.tag)
    consolidate(ckpt, config_dir, hf, auto_class, dtype)
    steps("reference: DeepSpeed's engine loads the original shards at world size %d", ckpt.world_size)
    reference, how = reference_logits(ckpt, config_dir, ids, work, auto_class)
    return hf, compare_with_trainer(reference, hf, ids, auto_class=auto_class, dtype=dtype, atol=atol, output=output,
                                    allow_drift=allow_drift, reference_model=reference_name(ckpt), reference_command=how)

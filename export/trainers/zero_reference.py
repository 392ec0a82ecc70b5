"""The parity reference of a ZeRO conversion: the trainer's own model, DeepSpeed's engine, loaded from the
original ZeRO checkpoint at the world size that wrote it, run on the sample prompts.

Started by export/trainers/zero.py as
`torchrun --nproc-per-node W -m export.trainers.zero_reference CKPT TAG CONFIG IDS OUT AUTO_CLASS STAGE`
(gloo on CPU); rank 0 writes the first output (logits, or the last hidden state of a bare encoder) of every
input to OUT (.npz).
"""

import json
import sys

import numpy as np
import torch


def main(checkpoint: str, tag: str, config_dir: str, ids_file: str, out: str, auto_class: str, stage: str) -> None:
    import deepspeed
    import transformers

    from export.parity import first_outputs
    from transformers import AutoConfig

    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    # The engine needs an optimizer to load ZeRO-3's fp32 partitions; no step is taken.
    ds_config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "zero_optimization": {"stage": int(stage)},
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}}}
    config = AutoConfig.from_pretrained(config_dir)
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    path, _ = engine.load_checkpoint(checkpoint, tag=tag, load_optimizer_states=False, load_lr_scheduler_states=False)
    if path is None:
        raise SystemExit(f"DeepSpeed could not load {checkpoint} (tag {tag})")
    engine.eval()
    prompts = json.loads(open(ids_file).read())
    logits = {}
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            logits[f"p{i}"] = first_outputs(engine, [ids])[0]
    if torch.distributed.get_rank() == 0:
        np.savez(out, **logits)
    torch.distributed.barrier()
    # gloo's threads joined before the interpreter exits: left to exit, a rank could abort in teardown ("terminate
    # called without an active exception", SIGABRT) after its work was done, and torchrun reports the run failed
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:8])

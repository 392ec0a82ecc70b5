"""Checkpoints written by the real trainers, for the export tests: built once, cached by the hash of this
folder's sources and the trainers' versions (`python -m tests.trainer_checkpoints.build [ROOT]`).

- `lf-lora`, `lf-qlora`, `lf-full`: LLaMA-Factory's own CLI, LoRA, QLoRA (4-bit base, bitsandbytes' CPU
  backend) and full SFT of the tiny Llama (`base`) for 3 steps, launched the way LLaMA-Board launches it: the
  arguments saved as `training_args.yaml` in the output folder;
- `lf-zero3`: the same full SFT through DeepSpeed ZeRO-3 on 2 ranks with 16-bit gathering off, so the run
  leaves only `global_step3/` shards (and `zero_to_fp32.py`), no model weights;
- `megatron-tp2`, `megatron-tp2-tied`: Megatron-core, tensor parallelism 2, saved by its own distributed
  checkpointing (megatron_gpt.py); the second shares its embedding and output weights, Megatron's default;
- `bert-zero3`: the fixture BERT classifier fine-tuned by the Hugging Face Trainer under DeepSpeed ZeRO-3 on
  2 ranks (hf_trainer_zero3.py): its `checkpoint-3/` holds shards, config and tokenizer, no weights.

LLaMA-Factory runs in its own environment (.envs/llamafactory: its transformers pin differs from ours), and so
does the Trainer run (transformers 5.23's Trainer sees one process under torchrun on CPU, so DeepSpeed's batch
check fails; LLaMA-Factory's 5.6 sees both). DeepSpeed and Megatron-core are in the main environment too
(the export needs them).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import platformdirs
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LLAMAFACTORY_ENV = REPO / ".envs" / "llamafactory"
# In the user's cache, not the checkout: a fresh clone on a machine that built them once reuses them (the key is
# the content hash of their sources and the trainers' versions). RTXSERVE_CACHE_DIR moves it.
DEFAULT_ROOT = Path(os.environ.get("RTXSERVE_CACHE_DIR") or platformdirs.user_cache_path("rtxserve")) / "trainer-checkpoints"
NAMES = {"base": "base", "lf-lora": "lf-lora", "lf-qlora": "lf-qlora", "lf-full": "lf-full", "lf-zero3": "lf-zero3",
         "megatron-tp2": "megatron-tp2", "megatron-tp2-tied": "megatron-tp2-tied", "bert-zero3": "bert-zero3/checkpoint-3"}

SFT = {
    "stage": "sft", "do_train": True, "dataset": "orders", "template": "default", "cutoff_len": 128,
    "overwrite_cache": True, "preprocessing_num_workers": 1, "dataloader_num_workers": 0,
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "learning_rate": 1.0e-3, "max_steps": 3,
    "save_steps": 3, "logging_steps": 1, "bf16": False, "fp16": False, "report_to": "none", "seed": 0,
}
RUNS = {
    "lf-lora": {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "use_cpu": True},
    "lf-qlora": {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "quantization_bit": 4, "use_cpu": True},
    "lf-full": {"finetuning_type": "full", "use_cpu": True},
    # DeepSpeed on CPU needs the gloo process group; use_cpu would turn distributed training off.
    "lf-zero3": {"finetuning_type": "full", "ddp_backend": "gloo", "deepspeed": "ds_z3_config.json"},
}
ZERO3 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
    "bf16": {"enabled": False}, "fp16": {"enabled": False},
}


def _key() -> str:
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.py")):
        digest.update(path.read_bytes())
    for path in sorted((REPO / "fixture_models").glob("*.py")):  # the base models it trains from
        digest.update(path.read_bytes())
    for dist in ("torch", "transformers", "deepspeed", "megatron-core"):
        digest.update(importlib.metadata.version(dist).encode())
    return digest.hexdigest()[:16]


# A torchrun rank that aborts as its interpreter exits, after its work: a thread of gloo's still joinable at exit
# (seen in two cold CI runs out of three, in LLaMA-Factory's ZeRO-3 run, whose launcher is not ours to change).
TEARDOWN_ABORT = "terminate called without an active exception"
# The last thing a run prints once its checkpoint is saved: LLaMA-Factory's metrics table (after its save_model), and
# hf_trainer_zero3.py's own line (after the Trainer's last checkpoint and the process group's end)
TRAINED = ("***** train metrics *****", "[rtxserve] trained and saved")


def _run(argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
    with open(log, "w") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
    if done.returncode != 0:
        text = log.read_text()
        if TEARDOWN_ABORT in text and any(m in text for m in TRAINED):  # its work is done: the tests check every weight
            with open(log, "a") as out:
                out.write(f"\n[rtxserve] accepted: trained and saved, then a rank aborted in teardown ({done.returncode})\n")
            return
        tail = "\n".join(text.splitlines()[-30:])
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}); log {log}:\n{tail}")


def _llamafactory(work: Path, name: str) -> None:
    """Write the run's arguments as training_args.yaml in its output folder (LLaMA-Board's save_cmd) and train."""
    out = work / name
    out.mkdir()
    args = {"model_name_or_path": str(work / "base"), "dataset_dir": str(work / "data"), **SFT, **RUNS[name],
            "output_dir": str(out)}
    if "deepspeed" in args:
        (work / args["deepspeed"]).write_text(json.dumps(ZERO3, indent=2))
        args["deepspeed"] = str(work / args["deepspeed"])
    (out / "training_args.yaml").write_text(yaml.safe_dump(args, sort_keys=False))
    env = {"PATH": f"{LLAMAFACTORY_ENV / 'bin'}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
           "DISABLE_VERSION_CHECK": "1"}
    if "deepspeed" in args:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    _run([str(LLAMAFACTORY_ENV / "bin" / "llamafactory-cli"), "train", str(out / "training_args.yaml")],
         work / f"{name}.log", env, cwd=work)


def build(root: Path = DEFAULT_ROOT) -> dict[str, Path]:
    """Every checkpoint, built if the cache has none for these sources and versions."""
    done = root / _key()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # one build at a time, whichever checkout asks (the cache is shared)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done / "DONE").is_file():
            _build(root, done)
    return {name: done / folder for name, folder in NAMES.items()}


def _build(root: Path, done: Path) -> None:
    from fixture_models.llm import write_llm
    from fixture_models.text import write_text_classifier

    if not (LLAMAFACTORY_ENV / "bin" / "llamafactory-cli").is_file():
        raise RuntimeError(f"no LLaMA-Factory in {LLAMAFACTORY_ENV}: run `make setup-trainers`")
    # Built in place (the runs record absolute paths: the adapter's base, Megatron's tokenizer); DONE marks
    # a finished build, and an unfinished one is started afresh.
    work = done
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    write_llm(work / "base")
    data = work / "data"
    data.mkdir()
    rows = [{"instruction": f"where is order {i}?", "input": "", "output": f"order {i} ships on tuesday"}
            for i in range(16)]
    (data / "orders.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"orders": {"file_name": "orders.json"}}))
    write_text_classifier(work / "bert-base")
    trainers = {"PATH": f"{LLAMAFACTORY_ENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    runs = [functools.partial(_run, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                     str(HERE / "megatron_gpt.py"), str(work / name), str(work / "base"), "--tp", "2", *extra],
                              work / f"{name}.log")
            for name, extra in (("megatron-tp2", []), ("megatron-tp2-tied", ["--tied"]))]
    runs.append(functools.partial(_run, [str(LLAMAFACTORY_ENV / "bin" / "python"), "-m", "torch.distributed.run",
                                         "--standalone", "--nproc-per-node=2", str(HERE / "hf_trainer_zero3.py"),
                                         str(work / "bert-base"), str(work / "bert-zero3")],
                                  work / "bert-zero3.log", trainers))
    runs += [functools.partial(_llamafactory, work, name) for name in RUNS]
    # Two at a time: each run spends most of its time importing its trainer, one core's work, so two share this
    # 2-core machine well (314 s one after another on a cold machine).
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(run) for run in runs]:
            future.result()
    (work / "DONE").write_text("")
    for stale in root.iterdir():  # builds for other sources or versions
        if stale.is_dir() and stale != done:
            shutil.rmtree(stale, ignore_errors=True)


if __name__ == "__main__":
    for name, path in build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_ROOT).items():
        print(f"{name}: {path}")

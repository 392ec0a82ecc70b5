"""What the trainers really write, exported and served: LLaMA-Factory's own CLI (LoRA and full SFT),
LLaMA-Factory + DeepSpeed ZeRO-3 on 2 ranks (shards only, no weights) and Megatron-core with TP=2, each
through `rtxserve export llm`, the real vLLM server and the gateway, with the `openai` SDK. Bad layouts
fail with errors that name what is wrong, and leave nothing behind."""

import concurrent.futures
import contextlib
import io
import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import openai
import pytest
import torch
import yaml

from rtxserve.cli import main as cli_main
from serve.stack import start_gateway, start_vllm
from serve.vllm_server import VLLMOptions
from tests.integration import VLLM_EAGER
from tests.trainer_checkpoints.build import build


@pytest.fixture(scope="module")
def runs():
    return build()


def export(*args):
    return subprocess.run([sys.executable, "-m", "rtxserve.cli", "export", "llm", *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def refused(*args, fmt="llm"):
    """`rtxserve export FMT ARGS` that must be refused, run by the CLI's own main in this process (its exit code
    and what it printed are the same; a process of its own would spend 9 s importing torch, DeepSpeed and
    Megatron first). The exports that succeed run as users run them, in processes of their own."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(printed):
        try:
            code = cli_main(["export", fmt, *map(str, args)])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
    return SimpleNamespace(returncode=code, stdout="", stderr=printed.getvalue())


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """Every run exported once: name -> package folder. Two exports at a time: each spends most of its time
    importing torch, DeepSpeed and Megatron, one core's work (lf-zero3's parity reference, 2 ranks of DeepSpeed,
    takes as long as the other three together)."""
    out = tmp_path_factory.mktemp("exported")
    names = ("lf-zero3", "lf-lora", "lf-full", "megatron-tp2")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(names, pool.map(lambda name: export(runs[name], "--out", out / name), names)))
    for name, run in done.items():
        assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
    return {name: out / name for name in names}


def metadata(package):
    return json.loads((package / "rtxserve.json").read_text())


def test_llamafactory_runs_are_recognised_from_training_args(exported):
    lora, full = metadata(exported["lf-lora"]), metadata(exported["lf-full"])
    assert lora["kind"] == "lora" and full["kind"] == "full"
    for meta, kind in ((lora, "lora"), (full, "full")):
        trained = meta["trained_with"]
        assert trained["trainer"] == "llama-factory" and trained["template"] == "default"
        assert trained["finetuning_type"] == kind and trained["global_step"] == 3
    assert lora["qlora"] is False
    # LLaMA-Factory renders its template into the tokenizer's chat template; the package carries it.
    assert "Human: " in (exported["lf-full"] / "chat_template.jinja").read_text()


@pytest.mark.parametrize("name, fmt", [("lf-zero3", "deepspeed-zero3"), ("megatron-tp2", "megatron-torch_dist")])
def test_conversions_match_the_trainers_own_model(exported, name, fmt):
    meta = metadata(exported[name])
    parity = json.loads((exported[name] / "parity.json").read_text())
    assert meta["converted_from"]["format"] == fmt and meta["parity_passed"] is True
    logits = parity["outputs"]["logits"]
    assert parity["passed"] and parity["cases"] == 6 and logits["max_abs_diff"] <= 1e-4
    assert logits["top1_agreement"] == 1.0
    if name == "lf-zero3":  # DeepSpeed's engine, in processes of its own at the world size that wrote the shards
        assert parity["reference"].startswith("DeepSpeed ZeRO-3 engine, world size 2")
        assert "export.trainers.zero_reference" in parity["reference_command"] and "--nproc-per-node=2" in parity["reference_command"]
    else:  # the Megatron model, loaded by the export itself
        assert parity["reference"].startswith("Megatron-core GPTModel")
        assert "export llm" in parity["reference_command"]


def test_zero3_conversion_holds_the_trained_weights(runs, exported):
    """The converted weights are the trained ones (3 AdamW steps at 1e-3 moved every matrix), not the base's."""
    from safetensors.torch import load_file

    trained = load_file(exported["lf-zero3"] / "model.safetensors")
    base = load_file(runs["base"] / "model.safetensors")
    assert trained.keys() == base.keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(trained[name], base[name])
    assert torch.allclose(trained[name], base[name], atol=0.05)


def test_megatron_tied_embeddings_and_a_16_bit_copy(runs, tmp_path):
    """Megatron's default shares the embedding with the output layer (no output_layer in the checkpoint); a
    bfloat16 copy is checked at the 16-bit tolerance."""
    done = export(runs["megatron-tp2-tied"], "--out", tmp_path / "tied", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "tied" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    parity = json.loads((tmp_path / "tied" / "parity.json").read_text())
    assert parity["passed"] and parity["atol"] == 0.25 and parity["outputs"]["logits"]["top1_agreement"] >= 0.9


def test_megatron_tp2_shards_are_merged(runs, exported):
    meta = metadata(exported["megatron-tp2"])
    assert meta["converted_from"]["tensor_parallel"] == 2 and meta["architecture"] == "LlamaForCausalLM"
    config = json.loads((exported["megatron-tp2"] / "config.json").read_text())
    assert config["num_attention_heads"] == 2 and config["intermediate_size"] == 256 and config["vocab_size"] == 432


# A vLLM start is most of a minute here. lf-full's and lf-zero3's packages are Hugging Face folders with the
# trainer's own config.json, as megatron-tp2's is with the config.json rtxserve wrote from Megatron's arguments
# (the harder case, kept in `make test`); lf-lora's is a PEFT adapter, served as test_serve_up serves one. Their
# conversions are each checked against the trainer's own model (parity.json) in `make test` all the same.
SERVED_BY_A_SIBLING = pytest.mark.slow(reason="vLLM loads the same kind of package in the megatron-tp2 case or test_serve_up")


@pytest.mark.parametrize("name", [pytest.param(name, marks=SERVED_BY_A_SIBLING) for name in ("lf-lora", "lf-full", "lf-zero3")]
                         + ["megatron-tp2"])
def test_served_through_vllm_and_the_gateway(runs, exported, name, tmp_path):
    package = exported[name]
    if name == "lf-lora":
        opts = VLLMOptions(model=runs["base"], served_name="base", max_model_len=256, adapters={name: package},
                           extra_args=VLLM_EAGER)
    else:
        opts = VLLMOptions(model=package, served_name=name, max_model_len=256, extra_args=VLLM_EAGER)
    vllm, vllm_url = start_vllm(opts, tmp_path)
    try:
        gateway, url = start_gateway("", tmp_path, vllm_url=vllm_url)
        try:
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            assert name in {m.id for m in sdk.models.list()}
            # ignore_eos: a trainer's run is not bit-reproducible on CPU threads, and a briefly trained model may
            # answer with end-of-sequence first (CI saw content '' once); the test is that it generates, served
            answer = sdk.chat.completions.create(model=name, messages=[{"role": "user", "content": "where is order 3?"}],
                                                 max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            choice = answer.choices[0]
            assert answer.usage.prompt_tokens > 5 and answer.usage.completion_tokens == 8
            assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
            print(f"{name}: {choice.message.content!r} ({choice.finish_reason})")
        finally:
            gateway.stop()
    finally:
        vllm.stop()


# --- bad layouts -------------------------------------------------------------------------------------------

def copy(src, dst):
    return shutil.copytree(src, dst, symlinks=True)


def failed(done, *fragments):
    assert done.returncode == 2, done.stdout + done.stderr
    message = done.stderr
    assert "Traceback" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_zero_folder_missing_a_rank_names_the_file(runs, tmp_path):
    broken = copy(runs["lf-zero3"], tmp_path / "z3")
    (broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    failed(refused(broken, "--out", tmp_path / "out"), "written by 2 ranks",
           "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert not (tmp_path / "out").exists()


def _edit_megatron_args(runs, tmp_path, **changes):
    broken = copy(runs["megatron-tp2"], tmp_path / "mcore")
    common = broken / "iter_0000003" / "common.pt"
    state = torch.load(common, weights_only=False)
    for key, value in changes.items():
        setattr(state["args"], key, value)
    torch.save(state, common)
    return broken


def test_megatron_tp_degree_that_contradicts_its_metadata_names_both(runs, tmp_path):
    broken = _edit_megatron_args(runs, tmp_path, tensor_model_parallel_size=4)
    failed(refused(broken, "--out", tmp_path / "out"), "split 2 ways", "tensor_model_parallel_size=4")


def test_unknown_megatron_architecture_lists_the_supported_ones(runs, tmp_path):
    broken = _edit_megatron_args(runs, tmp_path, swiglu=False)
    failed(refused(broken, "--out", tmp_path / "out"), "swiglu=False", "LlamaForCausalLM", "Qwen2ForCausalLM")
    shutil.rmtree(broken)
    broken = _edit_megatron_args(runs, tmp_path, qk_layernorm=True)
    failed(refused(broken, "--out", tmp_path / "out"), "qk_layernorm=True is not mapped", "LlamaForCausalLM")


def test_drift_beyond_tolerance_writes_nothing_unless_allowed(runs, tmp_path):
    failed(refused(runs["megatron-tp2"], "--out", tmp_path / "out", "--atol", "0"), "drifted beyond atol=0")
    assert not (tmp_path / "out").exists()
    done = export(runs["megatron-tp2"], "--out", tmp_path / "out", "--atol", "0", "--allow-drift")
    assert done.returncode == 0, done.stderr[-2000:]
    parity = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert parity["passed"] is False and any("--allow-drift" in n for n in parity["notes"])


def test_llamafactory_finetuning_type_must_match_the_folder(runs, tmp_path):
    broken = copy(runs["lf-full"], tmp_path / "full")
    args = yaml.safe_load((broken / "training_args.yaml").read_text())
    (broken / "training_args.yaml").write_text(yaml.safe_dump({**args, "finetuning_type": "lora"}))
    failed(refused(broken, "--out", tmp_path / "out"), "finetuning_type: lora", "no adapter_config.json")


def test_a_run_folder_without_weights_names_its_checkpoints(runs, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-3").symlink_to(runs["lf-full"] / "checkpoint-3")
    failed(refused(run, "--out", tmp_path / "out"), "checkpoint-3")
    done = export(run / "checkpoint-3", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert metadata(tmp_path / "out")["trained_with"]["global_step"] == 3


def test_an_encoders_zero3_trainer_checkpoint_exports_to_onnx(runs, tmp_path):
    """`export onnx` takes the Trainer's checkpoint-N of ZeRO-3 shards: DeepSpeed consolidates them, its engine
    is the reference for the conversion, and ONNX Runtime is checked against the consolidated model."""
    done = subprocess.run([sys.executable, "-m", "rtxserve.cli", "export", "onnx", str(runs["bert-zero3"]),
                           "--task", "text-classification", "--name", "zbert", "--repository", str(tmp_path / "repo")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parity = json.loads((tmp_path / "repo" / "zbert_model" / "parity.json").read_text())
    conversion = parity["conversion"]
    assert conversion["passed"] and conversion["converted_from"] == {"format": "deepspeed-zero3", "tag": "global_step3",
                                                                      "world_size": 2}
    assert conversion["outputs"]["logits"]["max_abs_diff"] <= 1e-5 and conversion["cases"] >= 5
    assert parity["passed"] and parity["outputs"]["logits"]["max_abs_diff"] <= 1e-4
    broken = copy(runs["bert-zero3"], tmp_path / "broken")
    (broken / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
    failed(refused(broken, "--task", "text-classification", "--name", "zb2", "--repository", tmp_path / "repo",
                   fmt="onnx"), "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert not (tmp_path / "repo" / "zb2").exists()


def test_a_llamafactory_qlora_run_is_recognised_and_merges_into_the_full_precision_base(runs, tmp_path):
    done = export(runs["lf-qlora"], "--out", tmp_path / "module")
    assert done.returncode == 0, done.stderr[-2000:]
    meta = metadata(tmp_path / "module")
    assert meta["qlora"] is True and meta["trained_with"]["quantization_bit"] == 4
    assert "full-precision base" in done.stderr  # served on the unquantised base: said, not hidden
    done = export(runs["lf-qlora"], "--out", tmp_path / "merged", "--merge")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "quantised (QLoRA) base" in done.stderr
    parity = json.loads((tmp_path / "merged" / "parity.json").read_text())
    assert parity["passed"] and metadata(tmp_path / "merged")["qlora"] is True

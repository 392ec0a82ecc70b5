"""`rtxserve export llm` on the tiny Llama and its LoRA adapters: packaging, checks, merge parity."""

import json
import logging
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from export import cli
from export.exceptions import ExportError, ParityError
from fixture_models.llm import write_llm_with_adapters
from tests.conftest import built_once
from export.llm.llm import LLMOptions, export_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """The integration tests' tiny Llama and its adapters, built once per run (tests change only copies of it)."""
    return built_once(tmp_path_factory, "llm", write_llm_with_adapters)


def _nothing_written(out):
    return not out.exists() and not list(out.parent.glob(".rtxserve-export-*"))


def test_full_fine_tune_is_checked_and_packaged(llm, tmp_path):
    result = export_llm(llm / "base", tmp_path / "pkg")
    assert result.kind == "full"
    files = {p.name for p in (tmp_path / "pkg").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "rtxserve.json"} <= files
    meta = json.loads((tmp_path / "pkg" / "rtxserve.json").read_text())
    assert meta["kind"] == "full" and meta["architecture"] == "LlamaForCausalLM" and meta["dtype"] == "float32"
    assert meta["chat_template"] is True and meta["max_model_len"] == 512
    assert (tmp_path / "pkg" / "model.safetensors").read_bytes() == (llm / "base" / "model.safetensors").read_bytes()
    assert result.serve_command == f"rtxserve serve vllm {tmp_path / 'pkg'} --served-model-name pkg"


def test_missing_chat_template_is_warned_and_can_be_added(llm, tmp_path, caplog):
    src = tmp_path / "no-template"
    shutil.copytree(llm / "base", src)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        export_llm(src, tmp_path / "a")
    assert "no chat template" in caplog.text
    assert not json.loads((tmp_path / "a" / "rtxserve.json").read_text())["chat_template"]
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    export_llm(src, tmp_path / "b", LLMOptions(chat_template=template))
    assert (tmp_path / "b" / "chat_template.jinja").read_text() == template.read_text()


def test_truncated_weights_are_named_and_nothing_is_written(llm, tmp_path):
    src = tmp_path / "broken"
    shutil.copytree(llm / "base", src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ExportError, match=r"model.safetensors is truncated"):
        export_llm(src, tmp_path / "out")
    assert _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), "save them as safetensors"),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]})),
     "needs a \\*ForCausalLM"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
])
def test_bad_checkpoints_get_a_clear_error(llm, tmp_path, damage, message):
    src = tmp_path / "src"
    shutil.copytree(llm / "base", src)
    damage(src)
    with pytest.raises(ExportError, match=message):
        export_llm(src, tmp_path / "out")
    assert _nothing_written(tmp_path / "out")


def test_adapter_is_checked_against_its_base_and_packaged_for_vllm(llm, tmp_path):
    result = export_llm(llm / "adapter-a", tmp_path / "lora", LLMOptions(base=llm / "base"))
    assert result.kind == "lora"
    assert {p.name for p in (tmp_path / "lora").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "rtxserve.json"}
    meta = json.loads((tmp_path / "lora" / "rtxserve.json").read_text())
    assert meta["rank"] == 8 and sorted(meta["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert meta["base"] == str((llm / "base").resolve()) and meta["qlora"] is False
    assert f"--lora lora={tmp_path / 'lora'}" in result.serve_command


def test_adapter_on_another_base_is_refused_with_both_names(llm, tmp_path):
    other = tmp_path / "other-base"
    shutil.copytree(llm / "base", other)
    weights = load_file(other / "model.safetensors")  # another model: its attention projects to 256
    save_file({k: np.zeros((256, v.shape[1]), v.dtype) if k.endswith("q_proj.weight") else v
               for k, v in weights.items()}, other / "model.safetensors")
    with pytest.raises(ExportError) as info:
        export_llm(llm / "adapter-a", tmp_path / "out", LLMOptions(base=other))
    assert str(other) in str(info.value) and str(llm / "base") in str(info.value) and "shape" in str(info.value)
    assert _nothing_written(tmp_path / "out")


def test_modules_to_save_cannot_be_a_vllm_module_but_can_be_merged(llm, tmp_path):
    src = tmp_path / "adapter"
    shutil.copytree(llm / "adapter-b", src)
    config = json.loads((src / "adapter_config.json").read_text())
    (src / "adapter_config.json").write_text(json.dumps(config | {"modules_to_save": ["lm_head"]}))
    with pytest.raises(ExportError, match="--merge"):
        export_llm(src, tmp_path / "out", LLMOptions(base=llm / "base"))


def test_merge_matches_base_plus_adapter_and_saves_the_figures(llm, tmp_path):
    result = export_llm(llm / "adapter-a", tmp_path / "merged", LLMOptions(merge=True))
    assert result.kind == "merged"
    parity = json.loads((tmp_path / "merged" / "parity.json").read_text())
    logits = parity["outputs"]["logits"]
    assert parity["passed"] and parity["cases"] == 6 and logits["top1_agreement"] == 1.0
    meta = json.loads((tmp_path / "merged" / "rtxserve.json").read_text())
    # The check means something only if the adapter moves the logits far more than merging does.
    assert meta["adapter_effect_max_abs"] > 1000 * max(logits["max_abs_diff"], 1e-9)
    assert meta["kind"] == "merged" and meta["parity_passed"]
    assert not (tmp_path / "merged" / "adapter_config.json").exists()  # standalone: no adapter left


def test_merge_drift_beyond_tolerance_fails_unless_allowed(llm, tmp_path):
    with pytest.raises(ParityError, match="logits"):
        export_llm(llm / "adapter-b", tmp_path / "out", LLMOptions(merge=True, atol=1e-12))
    assert _nothing_written(tmp_path / "out")
    export_llm(llm / "adapter-b", tmp_path / "out", LLMOptions(merge=True, atol=1e-12, allow_drift=True))
    parity = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert not parity["passed"] and any("--allow-drift" in n for n in parity["notes"])


def test_qlora_adapter_merges_with_a_warning(llm, tmp_path, caplog):
    src = tmp_path / "qlora"
    shutil.copytree(llm / "adapter-a", src)
    (src / "training_args.yaml").write_text("finetuning_type: lora\nquantization_bit: 4\n")
    with caplog.at_level(logging.WARNING):
        export_llm(src, tmp_path / "out", LLMOptions(merge=True))
    assert "quantised (QLoRA)" in caplog.text
    assert json.loads((tmp_path / "out" / "rtxserve.json").read_text())["qlora"] is True


def test_cli_reports_errors_in_one_line_and_refuses_to_overwrite(llm, tmp_path, capsys):
    assert cli.main(["llm", str(llm / "base"), "--out", str(tmp_path / "p")]) == 0
    assert "serve it: rtxserve serve vllm" in capsys.readouterr().out
    assert cli.main(["llm", str(llm / "base"), "--out", str(tmp_path / "p")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert cli.main(["llm", str(tmp_path / "nope"), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err


def _as_qwen2_vl(llm, tmp_path, template: str | None):
    """The tiny Llama's files relabelled as a Qwen2-VL checkpoint: what the checks read is config, files, template."""
    src = shutil.copytree(llm / "base", tmp_path / "vl")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2VLForConditionalGeneration"]}))
    if template is not None:
        (src / "chat_template.jinja").write_text(template)
    return src


def test_vision_language_checkpoints_need_their_processor_and_image_placeholder(llm, tmp_path):
    src = _as_qwen2_vl(llm, tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ExportError, match="no processor config"):
        export_llm(src, tmp_path / "pkg")
    (src / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    with pytest.raises(ExportError, match=r"never writes <\|image_pad\|>"):
        export_llm(src, tmp_path / "pkg")
    assert _nothing_written(tmp_path / "pkg")
    good = tmp_path / "vl.jinja"
    good.write_text("{% for m in messages %}<|vision_start|><|image_pad|><|vision_end|>{% endfor %}")
    result = export_llm(src, tmp_path / "pkg", LLMOptions(chat_template=good))
    assert (tmp_path / "pkg" / "chat_template.jinja").read_text() == good.read_text()
    # the checkpoint's own template is left as it was (the package's may have been a hard link to it)
    assert (src / "chat_template.jinja").read_text() == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    meta = json.loads((tmp_path / "pkg" / "rtxserve.json").read_text())
    assert meta["vision"] is True and (tmp_path / "pkg" / "preprocessor_config.json").is_file()
    assert "--max-images-per-prompt" in result.serve_command


def test_an_unknown_architecture_lists_what_is_supported(llm, tmp_path):
    src = shutil.copytree(llm / "base", tmp_path / "x")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["WhisperForConditionalGeneration"]}))
    with pytest.raises(ExportError, match="Blip2ForConditionalGeneration"):
        export_llm(src, tmp_path / "pkg")

"""LoRA adapters on encoder tasks: resolved and checked against their base, merged, compared with the PeftModel."""

import json
import shutil

import pytest
import torch

from export.encoders.task_specs import ENCODER_TASKS
from export.encoders.adapters import is_adapter, load_models, resolve_adapter
from export.exceptions import ExportError
from fixture_models.text import LABELS, write_encoder_adapter, write_text_classifier

TEXTS = ["I love this product, it works perfectly.", "Terrible. It broke after one day!", "ok"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_text_classifier(tmp_path_factory.mktemp("adapters") / "base", train_steps=5, checked=False)


@pytest.fixture(scope="module")
def adapter(base):
    return write_encoder_adapter(base, base.parent / "adapter")


def _write_classifier(base, out, **shape):
    """A randomly initialised BERT classifier with `base`'s tokenizer and config, `shape` overridden."""
    from transformers import AutoConfig, BertForSequenceClassification

    config = AutoConfig.from_pretrained(base)
    for key, value in shape.items():
        setattr(config, key, value)
    BertForSequenceClassification(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, out / name)
    return out


def _logits(model, tokenizer, texts=TEXTS):
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _edit_tensors(folder, edit):
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file(edit(load_file(path)), path)


def test_adapter_is_resolved_to_its_recorded_base(base, adapter):
    assert is_adapter(adapter) and not is_adapter(base)
    resolved = resolve_adapter(adapter, "text-classification")
    assert resolved.base_path == base
    assert resolved.adapter.rank == 8 and set(resolved.adapter.targets) == {"query", "value"}
    ckpt = resolved.checkpoint
    assert ckpt.path == base  # the adapter folder holds no tokenizer
    assert ckpt.architecture == "BertForSequenceClassification"
    assert ckpt.weights == adapter / "adapter_model.safetensors"
    assert ckpt.labels == LABELS and ckpt.config["hidden_size"] == 64


def test_merged_model_matches_the_peft_model_and_the_adapter_changes_the_outputs(base, adapter):
    resolved = resolve_adapter(adapter, "text-classification")
    merged, reference = load_models(resolved, ENCODER_TASKS["text-classification"].auto_class)
    assert type(merged).__name__ == "BertForSequenceClassification"
    assert not any("lora" in name for name, _ in merged.named_modules())
    tokenizer = _tokenizer(resolved.checkpoint.path)
    got, want = _logits(merged, tokenizer), _logits(reference, tokenizer)
    assert (got - want).abs().max().item() < 1e-4
    with reference.disable_adapter():
        bare = _logits(reference, tokenizer)
    assert (want - bare).abs().max().item() > 1e-3


def test_an_adapter_head_with_its_own_labels_sets_the_label_count(base, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=5, ignore_mismatched_sizes=True)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["query"], modules_to_save=["classifier"],
                                                  task_type="SEQ_CLS"))
    out = tmp_path / "five"
    peft_model.save_pretrained(out)
    _tokenizer(base).save_pretrained(out)

    resolved = resolve_adapter(out, "text-classification")
    assert resolved.checkpoint.labels == [f"LABEL_{i}" for i in range(5)]
    assert resolved.checkpoint.path == out  # the adapter's own tokenizer
    names = ["a", "b", "c", "d", "e"]
    (out / "config.json").write_text(json.dumps({"id2label": dict(enumerate(names))}))
    resolved = resolve_adapter(out, "text-classification")
    assert resolved.checkpoint.labels == names
    merged, reference = load_models(resolved, "AutoModelForSequenceClassification")
    assert merged.config.id2label[4] == "e"
    tokenizer = _tokenizer(out)
    got, want = _logits(merged, tokenizer), _logits(reference, tokenizer)
    assert got.shape[-1] == 5 and (got - want).abs().max().item() < 1e-4
    assert isinstance(reference, PeftModel)


def test_a_base_of_another_shape_is_refused_naming_adapter_and_base(base, adapter, tmp_path):
    other = _write_classifier(base, tmp_path / "other-base", hidden_size=32, intermediate_size=64)
    with pytest.raises(ExportError) as info:
        resolve_adapter(adapter, "text-classification", base=other)
    message = str(info.value)
    assert str(adapter) in message and str(other) in message and str(base) in message
    assert "query.lora_A.weight has shape [8, 64], the base needs [8, 32]" in message
    assert "--base" in message


def test_a_saved_head_that_does_not_fit_the_base_is_refused(adapter, tmp_path):
    copy = shutil.copytree(adapter, tmp_path / "wide-head")
    _edit_tensors(copy, lambda t: t | {"base_model.model.classifier.weight": torch.zeros(3, 48)})
    with pytest.raises(ExportError, match=r"classifier\.weight has shape \[3, 48\], the base needs \[3, 64\].*--base"):
        resolve_adapter(copy, "text-classification")
    _edit_tensors(copy, lambda t: t | {"base_model.model.classifier.bias": torch.zeros(4)})
    with pytest.raises(ExportError, match=r"disagree on the number of labels \(\[3, 4\]\)"):
        resolve_adapter(copy, "text-classification")


def test_task_type_must_fit_the_task(adapter):
    with pytest.raises(ExportError, match=r"task_type SEQ_CLS.*task feature-extraction.*--task text-classification"):
        resolve_adapter(adapter, "feature-extraction")


def test_a_bare_encoder_adapter_fits_feature_extraction_only(base, tmp_path):
    adapter = write_encoder_adapter(base, tmp_path / "bare", task="feature-extraction")
    resolved = resolve_adapter(adapter, "feature-extraction")
    assert resolved.checkpoint.architecture == "BertModel"
    _edit_config(adapter, task_type=None)
    # Its tensors are named without the bert. prefix: they fit AutoModel, not a classifier.
    with pytest.raises(ExportError, match=r"encoder.layer.0.attention.self.query \(no such layer"):
        resolve_adapter(adapter, "text-classification")


def test_a_missing_base_asks_for_base(adapter, tmp_path):
    copy = shutil.copytree(adapter, tmp_path / "moved")
    _edit_config(copy, base_model_name_or_path=str(tmp_path / "gone"))
    with pytest.raises(ExportError, match=r"gone is not a local folder.*--base PATH"):
        resolve_adapter(copy, "text-classification")
    _edit_config(copy, base_model_name_or_path=None)
    with pytest.raises(ExportError, match=r"records no base model; pass it with --base"):
        resolve_adapter(copy, "text-classification")


def test_a_pickled_adapter_is_refused(adapter, tmp_path):
    copy = shutil.copytree(adapter, tmp_path / "pickled")
    (copy / "adapter_model.safetensors").rename(copy / "adapter_model.bin")
    with pytest.raises(ExportError, match=r"adapter_model.bin is pickled.*safe_serialization=True"):
        resolve_adapter(copy, "text-classification")


def test_a_headless_adapter_on_a_headless_base_is_refused(base, adapter, tmp_path):
    from transformers import AutoConfig, BertForMaskedLM

    config = AutoConfig.from_pretrained(base)
    config.architectures = ["BertForMaskedLM"]
    mlm = tmp_path / "mlm"
    BertForMaskedLM(config).save_pretrained(mlm)
    headless = shutil.copytree(adapter, tmp_path / "headless")
    _edit_tensors(headless, lambda t: {k: v for k, v in t.items() if "classifier" not in k})
    resolve_adapter(headless, "text-classification")  # the fine-tuned base has the head
    with pytest.raises(ExportError, match="saves no text-classification head.*head would be random"):
        resolve_adapter(headless, "text-classification", base=mlm)


def test_token_classification_adapter_merges(tmp_path):
    from fixture_models.text import write_ner_tagger

    tagger = write_ner_tagger(tmp_path / "ner", train_steps=2, checked=False)
    adapter = write_encoder_adapter(tagger, tmp_path / "ner-adapter", task="token-classification")
    resolved = resolve_adapter(adapter, "token-classification")
    assert resolved.checkpoint.architecture == "BertForTokenClassification"
    with pytest.raises(ExportError, match="task_type TOKEN_CLS"):
        resolve_adapter(adapter, "text-classification")
    merged, reference = load_models(resolved, ENCODER_TASKS["token-classification"].auto_class)
    tokenizer = _tokenizer(resolved.checkpoint.path)
    texts = ["anna moved to paris"]
    got, want = _logits(merged, tokenizer, texts), _logits(reference, tokenizer, texts)
    assert (got - want).abs().max().item() < 1e-4


def test_export_of_an_adapter_is_merged_and_checked_against_the_peft_model(base, adapter, tmp_path, capsys):
    from export.cli import main

    repo = tmp_path / "repo"
    assert main(["onnx", str(adapter), "--task", "text-classification", "--name", "lora", "--repository", str(repo)]) == 0
    assert "parity passed" in capsys.readouterr().out
    parity = json.loads((repo / "lora_model" / "parity.json").read_text())
    assert parity["passed"] and parity["outputs"]["logits"]["max_abs_diff"] < 1e-4
    assert parity["adapter_effect_max_abs"] > 1e-2  # the reference really is base + adapter, not the base
    assert any("unmerged PeftModel" in n for n in parity["notes"])
    metadata = json.loads((repo / "lora" / "rtxserve.json").read_text())
    assert metadata["adapter"]["base"] == str(base.resolve()) and metadata["adapter"]["merged"]
    assert metadata["labels"] == LABELS


def test_export_of_an_adapter_on_the_wrong_base_fails_and_writes_nothing(base, adapter, tmp_path, capsys):
    from export.cli import main

    other = _write_classifier(base, tmp_path / "other", hidden_size=32, intermediate_size=64)
    repo = tmp_path / "repo"
    assert main(["onnx", str(adapter), "--task", "text-classification", "--name", "lora", "--repository", str(repo),
                 "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "--base" in err and "Traceback" not in err
    assert not repo.exists() or not any(repo.iterdir())

"""Export of the fixture classifier: parity against PyTorch, and bad input that leaves nothing behind."""

import json
import shutil

import pytest

from export import cli
from export.encoders.encoder import EncoderOptions, export_text_classification
from export.exceptions import ExportError, ParityError
from export.triton.entry import EntryOptions


def _leftovers(repo):
    """Anything an export left: entries in the repository or staging folders beside it."""
    inside = list(repo.iterdir()) if repo.exists() else []
    staging = list(repo.parent.glob(".rtxserve-export-*"))
    return inside + staging


def test_export_matches_pytorch_and_writes_a_complete_entry(classifier_checkpoint, tmp_path):
    repo = tmp_path / "repo"
    result = export_text_classification(classifier_checkpoint, EntryOptions(name="clf", instances=2), repo)
    assert result.parity["passed"]
    logits = result.parity["outputs"]["logits"]
    assert logits["max_abs_diff"] < 1e-4 and logits["top1_agreement"] == 1.0
    assert result.parity["cases"] == 7  # six single texts and one padded batch
    names = sorted(p.name for p in repo.iterdir())
    assert names == ["clf", "clf_model", "clf_postprocess", "clf_tokenizer"]
    assert (repo / "clf_model" / "1" / "model.onnx").stat().st_size > 0
    assert json.loads((repo / "clf_model" / "parity.json").read_text())["passed"]
    meta = json.loads((repo / "clf" / "rtxserve.json").read_text())
    assert meta["labels"] == ["negative", "neutral", "positive"] and meta["instances"] == 2
    assert "torch" in meta["versions"]
    assert (repo / "clf_tokenizer" / "1" / "tokenizer.json").exists()
    assert not list(tmp_path.glob(".rtxserve-export-*"))


def test_parity_breach_fails_and_writes_nothing_unless_drift_is_allowed(classifier_checkpoint, tmp_path):
    repo = tmp_path / "repo"
    with pytest.raises(ParityError, match="output 'logits' max abs diff"):
        export_text_classification(classifier_checkpoint, EntryOptions(name="clf"), repo, EncoderOptions(atol=1e-12))
    assert _leftovers(repo) == []
    result = export_text_classification(classifier_checkpoint, EntryOptions(name="clf"), repo, EncoderOptions(atol=1e-12, allow_drift=True))
    assert not result.parity["passed"] and "allowed by --allow-drift" in result.parity["notes"][-1]


def test_existing_entry_is_kept_without_force_and_replaced_with_it(classifier_checkpoint, tmp_path):
    repo = tmp_path / "repo"
    export_text_classification(classifier_checkpoint, EntryOptions(name="clf"), repo)
    marker = repo / "clf" / "keep.txt"
    marker.write_text("mine")
    with pytest.raises(ExportError, match="already exist.*--force"):
        export_text_classification(classifier_checkpoint, EntryOptions(name="clf"), repo)
    assert marker.exists()
    export_text_classification(classifier_checkpoint, EntryOptions(name="clf"), repo, EncoderOptions(force=True))
    assert not marker.exists() and (repo / "clf" / "config.pbtxt").exists()


def _run_cli(capsys, *args):
    code = cli.main(["onnx", *map(str, args)])
    return code, capsys.readouterr().err.strip().splitlines()


def _error_line(lines):
    """The CLI's last stderr line is its error; progress lines come before it."""
    errors = [line for line in lines if line.startswith("rtxserve export: error:")]
    assert len(errors) == 1, lines
    return errors[0]


@pytest.mark.parametrize("case", ["missing", "file", "no-config", "bad-json", "no-weights", "wrong-arch"])
def test_bad_checkpoints_get_one_line_exit_2_and_nothing_written(case, classifier_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad"
    if case == "file":
        bad.write_text("x")
    elif case != "missing":
        shutil.copytree(classifier_checkpoint, bad)
        if case == "no-config":
            (bad / "config.json").unlink()
        elif case == "bad-json":
            (bad / "config.json").write_text("{not json")
        elif case == "no-weights":
            (bad / "model.safetensors").unlink()
        elif case == "wrong-arch":
            config = json.loads((bad / "config.json").read_text())
            config["architectures"] = ["BertForMaskedLM"]
            (bad / "config.json").write_text(json.dumps(config))
    repo = tmp_path / "repo"
    code, lines = _run_cli(capsys, bad, "--task", "text-classification", "--name", "m", "--repository", repo)
    expected = {
        "missing": "checkpoint not found", "file": "is not a directory", "no-config": "no config.json",
        "bad-json": "is not valid JSON", "no-weights": "no model weights", "wrong-arch": "BertForMaskedLM",
    }[case]
    assert code == 2
    assert expected in _error_line(lines)
    assert _leftovers(repo) == []


def test_truncated_weights_are_named_in_the_error(classifier_checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(classifier_checkpoint, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    repo = tmp_path / "repo"
    code, lines = _run_cli(capsys, bad, "--task", "text-classification", "--name", "m", "--repository", repo)
    assert code == 2 and "model.safetensors" in _error_line(lines)
    assert _leftovers(repo) == []


def test_unsupported_task_lists_the_supported_ones(classifier_checkpoint, tmp_path, capsys):
    code, lines = _run_cli(capsys, classifier_checkpoint, "--task", "summarization", "--name", "m",
                           "--repository", tmp_path / "repo")
    assert code == 2 and lines == ["rtxserve export: error: unsupported task 'summarization'; supported tasks: feature-extraction, image-classification, object-detection, text-classification, token-classification"]


@pytest.mark.parametrize("given", ["weights/best.pt", "."])
def test_an_ultralytics_run_is_named_with_its_task(tmp_path, capsys, given):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "best.pt").write_bytes(b"not read")
    (tmp_path / "args.yaml").write_text("task: pose\nmodel: yolo11n-pose.pt\n")
    code, lines = _run_cli(capsys, tmp_path / given, "--task", "object-detection", "--name", "m",
                           "--repository", tmp_path / "repo")
    assert code == 2 and "is an Ultralytics pose model (its args.yaml says task: pose)" in lines[0] and len(lines) == 1


def test_calibration_images_without_tensorrt_are_for_a_yolos_int8_only(classifier_checkpoint, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(images / "a.png")
    repo = tmp_path / "repo"
    code, lines = _run_cli(capsys, classifier_checkpoint, "--task", "text-classification", "--name", "m",
                           "--repository", repo, "--calibration-images", images)
    assert code == 2 and "--calibration-images to a YOLO's --precision int8" in _error_line(lines)
    code, lines = _run_cli(capsys, classifier_checkpoint, "--task", "text-classification", "--name", "m",
                           "--repository", repo, "--calibration-images", images, "--precision", "int8")
    assert code == 2 and "dynamic and takes none" in _error_line(lines)
    assert _leftovers(repo) == []

"""TensorRT on a real GPU: fp16 and int8 plans of the fixture BERT classifier against ONNX Runtime, the plan's
Triton model, and the serve-time refusal of a plan whose recorded TensorRT version does not match."""

import json

import numpy as np
import pytest

trt = pytest.importorskip("tensorrt")
torch = pytest.importorskip("torch")

from export import onnx_export  # noqa: E402
from export.tensorrt.plan import Profile, build_plan, tensorrt_model  # noqa: E402
from export.tensorrt.runtime import run_plan  # noqa: E402
from export.triton.model_config import TensorSpec  # noqa: E402
from export.triton.entry import EntryOptions  # noqa: E402
from serve.tensorrt_check import check_plans, detect_compute_capability  # noqa: E402

NAMES = ["input_ids", "attention_mask", "token_type_ids"]
TEXTS = ["i love it, really great", "terrible and broken, i want a refund", "the package arrived on tuesday",
         "excellent", "my order: awful", "honestly wonderful experience overall", "box shipped today", "worst"]


def _cosines(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return np.einsum("ij,ij->i", ref, got) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))


@pytest.fixture(scope="module")
def exported(classifier_checkpoint, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(classifier_checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_checkpoint, attn_implementation="eager").eval()

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    path = tmp_path_factory.mktemp("trt") / "model.onnx"
    sample = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    onnx_export.export(Logits(model).eval(), {n: sample[n] for n in NAMES}, path, ["logits"])
    return path, tokenizer


def _feeds(tokenizer, texts, length):
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="np")
    return {n: enc[n].astype(np.int64) for n in NAMES}


@pytest.mark.parametrize("precision, min_cosine", [("fp16", 0.999), ("int8", 0.95)])
def test_plan_matches_onnx_runtime_and_records_what_built_it(exported, tmp_path, precision, min_cosine):
    import onnxruntime as ort

    onnx_path, tokenizer = exported
    profile = Profile.parse("1,4,8", "8,32,64", max_batch_size=8, max_length=64)
    calibration = [_feeds(tokenizer, (TEXTS * 2)[2 * i:2 * i + 4], 32) for i in range(4)] if precision == "int8" else None
    cache = tmp_path / "calibration.cache"
    plan = tmp_path / f"{precision}.plan"
    info = build_plan(onnx_path, plan, inputs={n: None for n in NAMES}, profile=profile, precision=precision,
                      calibration_feeds=calibration, workspace_gb=2, calibration_cache=cache)
    assert plan.stat().st_size > 0
    assert info["tensorrt_version"] == trt.__version__ and info["precision"] == precision
    major, minor = torch.cuda.get_device_capability(0)
    assert info["compute_capability"] == f"{major}.{minor}"
    assert info["inputs"] == {n: "TYPE_INT64" for n in NAMES}  # TensorRT 10 keeps the tokenizer's INT64
    if precision == "int8":
        assert info["calibration_batches"] == 4 and cache.stat().st_size > 0

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for texts, length in ((TEXTS[:4], 32), (TEXTS[4:5], 17), (TEXTS, 64)):
        feeds = _feeds(tokenizer, texts, length)
        (reference,) = session.run(["logits"], feeds)
        got = run_plan(plan, feeds)["logits"]
        assert got.shape == reference.shape
        assert _cosines(reference, got).min() >= min_cosine, (precision, texts)


def test_serve_check_refuses_a_plan_whose_tensorrt_version_was_tampered(exported, tmp_path):
    onnx_path, _ = exported
    plan = tmp_path / "model.plan"
    info = build_plan(onnx_path, plan, inputs={n: None for n in NAMES},
                      profile=Profile.parse("1,2,4", "8,16,32", max_batch_size=4, max_length=32), precision="fp16")
    model = tensorrt_model(EntryOptions(name="clf", target="gpu", max_batch_size=4), plan, NAMES,
                           (TensorSpec("logits", "TYPE_FP32", (3,)),), {"passed": True}, info)
    folder = tmp_path / "repo" / "clf_model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(model.config.to_pbtxt())
    (folder / "1" / "model.plan").write_bytes(plan.read_bytes())
    (folder / "tensorrt.json").write_text(model.files["tensorrt.json"])

    capability = detect_compute_capability() or info["compute_capability"]
    assert info["compute_capability"] in capability.split(",")
    assert check_plans(tmp_path / "repo", trt.__version__, capability) == []

    tampered = {**json.loads(model.files["tensorrt.json"]), "tensorrt_version": "9.9.9"}
    (folder / "tensorrt.json").write_text(json.dumps(tampered))
    (problem,) = check_plans(tmp_path / "repo", trt.__version__, capability)
    assert "'clf_model'" in problem and "TensorRT 9.9.9" in problem and "rebuild" in problem


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_rtxserve_export_builds_a_validated_tensorrt_entry(classifier_checkpoint, tmp_path, capsys, precision):
    from export.cli import main

    repo = tmp_path / "repo"
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("\n".join(TEXTS * 2))
    args = ["onnx", str(classifier_checkpoint), "--task", "text-classification", "--name", "clf", "--repository",
            str(repo), "--target", "gpu", "--tensorrt", "--precision", precision, "--max-batch-size", "8"]
    if precision == "int8":
        args += ["--calibration-texts", str(calibration)]
    assert main(args) == 0, capsys.readouterr().err
    parity = json.loads((repo / "clf_model" / "parity.json").read_text())
    assert parity["variant"] == f"tensorrt-{precision}" and parity["passed"]
    assert (repo / "clf_model" / "1" / "model.plan").stat().st_size > 0
    assert json.loads((repo / "clf_model" / "tensorrt.json").read_text())["tensorrt_version"] == trt.__version__


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_an_image_plan_takes_every_side_its_profile_ranges_over(tmp_path, precision):
    """A YOLO-shaped graph (stride-32 convolutions, images [B, 3, H, W] -> output0 [B, C, H/32 * W/32]) built with
    the side range export.detection.yolo.plan_profile gives it: every letterbox shape in the range runs and agrees with ONNX
    Runtime, calibrated (int8) at the whole square as export.detection.yolo.calibration_feeds makes it."""
    import onnxruntime as ort

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.SiLU(),
                                torch.nn.Conv2d(16, 32, 3, stride=16, padding=1), torch.nn.SiLU(),
                                torch.nn.Conv2d(32, 6, 1), torch.nn.Flatten(2)).eval()
    onnx_path = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.rand(1, 3, 64, 64),), str(onnx_path), input_names=["images"], output_names=["output0"],
                      dynamo=False, dynamic_axes={"images": {0: "b", 2: "h", 3: "w"}, "output0": {0: "b", 2: "anchors"}})
    rng = np.random.default_rng(0)
    calibration = [{"images": rng.random((2, 3, 128, 128), dtype=np.float32)} for _ in range(3)]
    info = build_plan(onnx_path, tmp_path / "model.plan", inputs={"images": (3, -1, -1)},
                      profile=Profile((1, 4, 4), side=(32, 128, 128)), precision=precision,
                      calibration_feeds=calibration if precision == "int8" else None, workspace_gb=2)
    assert info["profile"]["image_side"] == {"min": 32, "opt": 128, "max": 128}
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for shape in ((1, 3, 32, 32), (2, 3, 96, 128), (4, 3, 128, 64), (3, 3, 128, 128)):
        images = rng.random(shape, dtype=np.float32)
        (reference,) = session.run(["output0"], {"images": images})
        got = run_plan(tmp_path / "model.plan", {"images": images})["output0"]
        assert got.shape == reference.shape, shape
        flat = lambda a: a.reshape(a.shape[0], -1)  # noqa: E731
        assert _cosines(flat(reference), flat(got)).min() >= (0.999 if precision == "fp16" else 0.95), shape


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_rtxserve_export_builds_a_detr_plan_for_every_size_its_resize_makes(tmp_path, capsys, precision):
    """A DETR (images of each one's own size, 1 to 96 pixels a side here) through `rtxserve export`: the plan is
    checked against PyTorch on every sample image and through the served steps against the pipeline."""
    from export.cli import main
    from export.vision import sample_images
    from fixture_models.detection import probe_images, write_detector
    from tests.integration import png

    checkpoint = write_detector(tmp_path / "detr")
    calibration, samples = tmp_path / "calibration", tmp_path / "samples"
    calibration.mkdir()
    samples.mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(((48, 64), (64, 40), (30, 90), (64, 64))):
        (calibration / f"{i}.png").write_bytes(png(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)))
    for i, image in enumerate(probe_images()):  # a detection in each, as the fixture's build checked
        (samples / f"probe-{i}.png").write_bytes(png(image))
    for i, data in enumerate(sample_images()):  # then the odd sizes, modes and EXIF rotations
        suffix = "png" if data.startswith(b"\x89PNG") else "jpg"
        (samples / f"sample-{i}.{suffix}").write_bytes(data)
    args = ["onnx", str(checkpoint), "--task", "object-detection", "--name", "detr", "--repository", str(tmp_path / "repo"),
            "--target", "gpu", "--tensorrt", "--precision", precision, "--max-batch-size", "4",
            "--sample-images", str(samples)]
    assert main(args + (["--calibration-images", str(calibration)] if precision == "int8" else [])) == 0, \
        capsys.readouterr().err
    parity = json.loads((tmp_path / "repo" / "detr_model" / "parity.json").read_text())
    assert parity["variant"] == f"tensorrt-{precision}" and parity["passed"]
    assert parity["served"]["detections"] >= len(probe_images())
    info = json.loads((tmp_path / "repo" / "detr_model" / "tensorrt.json").read_text())
    assert info["profile"]["image_side"] == {"min": 1, "opt": 64, "max": 96}

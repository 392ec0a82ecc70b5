import json
import subprocess
import sys
import types

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from export.tensorrt import plan as trt_export, runtime as trt_runtime
from export.exceptions import ExportError
from export.tensorrt.plan import Profile, build_plan, tensorrt_model
from export.triton.model_config import TensorSpec
from export.triton.entry import EntryOptions
from serve import tensorrt_check
from serve.tensorrt_check import check_plans, detect_compute_capability, detect_tensorrt_version, plan_problems
from serve.triton_server import TritonInstall, TritonNotFound, TritonOptions, triton_command

TOKENS = ["input_ids", "attention_mask", "token_type_ids"]
INFO = {"tensorrt_version": "10.3.0.26", "precision": "fp16", "gpu": "NVIDIA GeForce RTX 4090", "compute_capability": "8.9",
        "profile": {"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {"min": 16, "opt": 128, "max": 512}},
        "build_seconds": 90.0, "inputs": {n: "TYPE_INT64" for n in TOKENS}}


def test_profile_parses_min_opt_max_and_defaults_to_the_entry_limits():
    p = Profile.parse("1,8,32", "16,128,512", max_batch_size=32, max_length=512)
    assert p.batch == (1, 8, 32) and p.seq == (16, 128, 512)
    assert Profile.parse(max_batch_size=16, max_length=128) == Profile((1, 16, 16), (1, 128, 128))
    assert Profile.parse(seq="64", max_batch_size=8, max_length=128).seq == (64, 64, 64)
    assert Profile.parse("1,4,8", max_batch_size=8).seq is None  # vision: no sequence range
    assert p.to_dict() == {"batch": {"min": 1, "opt": 8, "max": 32}, "sequence": {"min": 16, "opt": 128, "max": 512}}


@pytest.mark.parametrize("batch, seq, message", [
    ("1,x,32", None, r"--trt-batch '1,x,32': use MIN,OPT,MAX as positive integers"),
    ("1,8", None, "use MIN,OPT,MAX"),
    ("0,8,32", None, "positive integers"),
    ("1,64,32", None, "need MIN <= OPT <= MAX"),
    ("2,8,32", None, "min is 2: it must be 1"),
    ("1,8,16", None, "max is 16: it must equal --max-batch-size 32"),
    ("1,8,32", "16,600,512", "need MIN <= OPT <= MAX"),
    ("1,8,32", "16,128,1024", "--trt-seq max 1024 exceeds the entry's max length 512"),
])
def test_profile_rejects_bad_ranges_naming_the_flag(batch, seq, message):
    with pytest.raises(ValueError, match=message):
        Profile.parse(batch, seq, max_batch_size=32, max_length=512)


def test_profile_shapes_per_input_token_and_fixed_dims():
    p = Profile((1, 8, 32), (16, 128, 512))
    assert p.shapes(["input_ids", "attention_mask"]) == {
        "input_ids": ((1, 16), (8, 128), (32, 512)), "attention_mask": ((1, 16), (8, 128), (32, 512))}
    assert p.shapes({"pixel_values": (3, 224, 224)}) == {
        "pixel_values": ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))}
    with pytest.raises(ValueError, match="no sequence range: pass --trt-seq"):
        Profile((1, 8, 32)).shapes(["input_ids"])


def test_profile_shapes_of_an_image_whose_sides_follow_it():
    p = Profile((1, 4, 8), side=(32, 640, 640))
    assert p.shapes({"images": (3, -1, -1)}) == {"images": ((1, 3, 32, 32), (4, 3, 640, 640), (8, 3, 640, 640))}
    assert p.to_dict()["image_side"] == {"min": 32, "opt": 640, "max": 640}
    with pytest.raises(ValueError, match="no side range"):
        Profile((1, 4, 8)).shapes({"images": (3, -1, -1)})
    with pytest.raises(ValueError, match="image side 640,32,640: need MIN <= OPT <= MAX"):
        Profile((1, 4, 8), side=(640, 32, 640))


def _parse(config) -> model_config_pb2.ModelConfig:
    return text_format.Parse(config.to_pbtxt(), model_config_pb2.ModelConfig())


def _model(tmp_path, info=INFO, **opts):
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"plan")
    opts = {"name": "clf", "target": "gpu", "instances": 2, "max_batch_size": 32, "gpus": (0,), **opts}
    return tensorrt_model(EntryOptions(**opts), plan, TOKENS, (TensorSpec("logits", "TYPE_FP32", (3,)),),
                          {"passed": True}, info)


def test_tensorrt_model_is_a_tensorrt_plan_on_gpu_instances_with_its_versions(tmp_path):
    model = _model(tmp_path)
    config = _parse(model.config)
    assert config.name == "clf_model" and config.platform == "tensorrt_plan" and not config.backend
    assert config.default_model_filename == "model.plan" and config.max_batch_size == 32
    group = config.instance_group[0]
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and group.count == 2 and list(group.gpus) == [0]
    assert config.dynamic_batching.max_queue_delay_microseconds == 500
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [(n, model_config_pb2.TYPE_INT64, [-1]) for n in TOKENS]
    assert config.parameters["rtxserve_tensorrt_version"].string_value == "10.3.0.26"
    assert config.parameters["rtxserve_compute_capability"].string_value == "8.9"
    assert set(model.files) == {"1/model.plan", "parity.json", "tensorrt.json"}
    assert json.loads(model.files["tensorrt.json"])["entry"] == "clf"


def test_tensorrt_model_takes_fixed_image_inputs(tmp_path):
    plan = tmp_path / "model.plan"
    info = {**INFO, "inputs": {"pixel_values": "TYPE_FP32"}}
    model = tensorrt_model(EntryOptions(name="vit", target="gpu", max_batch_size=32), plan, {"pixel_values": (3, 224, 224)},
                           (TensorSpec("logits", "TYPE_FP32", (10,)),), {}, info)
    (image,) = _parse(model.config).input
    assert image.data_type == model_config_pb2.TYPE_FP32 and list(image.dims) == [3, 224, 224]


def test_tensorrt_model_refuses_cpu_targets_and_plans_smaller_than_the_batch(tmp_path):
    with pytest.raises(ValueError, match="use --target gpu"):
        _model(tmp_path, target="cpu", gpus=())
    small = {**INFO, "profile": {"batch": {"min": 1, "opt": 4, "max": 8}}}
    with pytest.raises(ValueError, match="batches up to 8 but the entry's max batch size is 32"):
        _model(tmp_path, info=small)


def test_build_plan_without_tensorrt_says_what_to_install_and_the_alternative(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(ExportError, match=r"pip install tensorrt-cu12.*`--target gpu` without --tensorrt"):
        build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", inputs={"input_ids": None},
                   profile=Profile((1, 8, 32), (1, 64, 64)), precision="fp16")


def test_build_plan_checks_arguments_before_touching_the_gpu(tmp_path):
    common = dict(inputs={"input_ids": None}, profile=Profile((1, 8, 32), (1, 64, 64)))
    with pytest.raises(ExportError, match="--calibration-texts FILE"):
        build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", precision="int8", **common)
    with pytest.raises(ExportError, match="unknown TensorRT precision 'bf8'"):
        build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", precision="bf8", **common)


def test_build_plan_refuses_old_tensorrt_and_machines_without_a_gpu(tmp_path, monkeypatch):
    common = dict(inputs={"input_ids": None}, profile=Profile((1, 8, 32), (1, 64, 64)))
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="8.6.1"))
    with pytest.raises(ExportError, match="TensorRT 8.6.1 is too old"):
        build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", **common)
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ExportError, match="no CUDA device is visible"):
        build_plan(tmp_path / "m.onnx", tmp_path / "m.plan", **common)


def test_calibration_batches_must_share_one_shape_inside_the_profile():
    shapes = Profile((1, 8, 32), (1, 64, 128)).shapes(["input_ids"])
    feeds = [{"input_ids": np.zeros((8, 64), np.int64)}, {"input_ids": np.zeros((8, 32), np.int64)}]
    with pytest.raises(ExportError, match="one shape"):
        trt_export._calibration_shapes(feeds, ["input_ids"], shapes)
    with pytest.raises(ExportError, match=r"outside the profile"):
        trt_export._calibration_shapes([{"input_ids": np.zeros((8, 256), np.int64)}], ["input_ids"], shapes)
    assert trt_export._calibration_shapes(feeds[:1], ["input_ids"], shapes) == {"input_ids": (8, 64)}


def _write(repo, model_dir):
    folder = repo / model_dir.config.name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(model_dir.config.to_pbtxt())
    for rel, source in model_dir.files.items():
        if isinstance(source, str):
            (folder / rel).write_text(source)


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    _write(repo, _model(tmp_path))
    (repo / "clf").mkdir()
    (repo / "clf" / "rtxserve.json").write_text(json.dumps({"command": "rtxserve export onnx ckpt --name clf --target gpu --tensorrt"}))
    (repo / "other_model").mkdir()
    (repo / "other_model" / "config.pbtxt").write_text('name: "other_model"\nplatform: "onnxruntime_onnx"\n')
    return repo


def test_check_plans_passes_a_matching_tensorrt_and_gpu(repo):
    assert check_plans(repo, "10.3.0", "8.9") == []
    assert check_plans(repo, None, None) == []  # unknown: nothing to compare against


def test_check_plans_names_both_versions_and_the_rebuild_command(repo):
    (problem,) = check_plans(repo, "10.7.0", "8.9")
    assert "'clf_model'" in problem and "TensorRT 10.3.0" in problem and "TensorRT 10.7.0" in problem
    assert "rebuild it on this machine with `rtxserve export onnx ckpt --name clf --target gpu --tensorrt`" in problem
    (problem,) = check_plans(repo, "10.3.0", "9.0")
    assert "compute capability 8.9 (NVIDIA GeForce RTX 4090)" in problem and "GPU has 9.0" in problem


def test_check_plans_reads_the_config_parameters_when_tensorrt_json_is_missing(repo):
    (repo / "clf_model" / "tensorrt.json").unlink()
    (repo / "clf" / "rtxserve.json").unlink()
    (problem,) = check_plans(repo, "10.8.0", "8.6,8.9")
    assert "TensorRT 10.3.0" in problem and "`rtxserve export onnx ... --target gpu --tensorrt`" in problem


def test_plan_problems_costs_nothing_without_plans(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')

    def boom(*a, **k):
        raise AssertionError("detection must not run without plans")

    monkeypatch.setattr(tensorrt_check, "detect_tensorrt_version", boom)
    monkeypatch.setattr(tensorrt_check, "detect_compute_capability", boom)
    assert plan_problems(tmp_path) == []


@pytest.fixture
def no_system_libs(monkeypatch):
    monkeypatch.setattr(tensorrt_check, "SYSTEM_LIB_DIRS", ())
    monkeypatch.setenv("LD_LIBRARY_PATH", "")


def test_detect_tensorrt_version_reads_libnvinfer_file_names(tmp_path, no_system_libs):
    lib = tmp_path / "triton" / "lib"
    lib.mkdir(parents=True)
    for name in ("libnvinfer.so.10", "libnvinfer.so.10.3.0", "libnvinfer_plugin.so.10.5.0", "libnvinfer.so.9.0.1"):
        (lib / name).write_bytes(b"")
    assert detect_tensorrt_version(tmp_path / "triton", allow_import=False) == "10.3.0"
    assert detect_tensorrt_version(None, [lib], allow_import=False) == "10.3.0"
    assert detect_tensorrt_version(tmp_path / "empty", allow_import=False) is None


def test_detect_tensorrt_version_falls_back_to_the_python_package(tmp_path, no_system_libs, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.7.0.23"))
    assert detect_tensorrt_version(tmp_path) == "10.7.0"
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert detect_tensorrt_version(tmp_path) is None


def test_detect_compute_capability_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(tensorrt_check.shutil, "which", lambda _: None)
    assert detect_compute_capability() is None
    monkeypatch.setattr(tensorrt_check.shutil, "which", lambda _: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(tensorrt_check.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="8.9\n8.9\n8.6\n", stderr=""))
    assert detect_compute_capability() == "8.6,8.9"


def test_triton_launch_refuses_plans_of_another_tensorrt(tmp_path, repo, no_system_libs, monkeypatch):
    root = tmp_path / "tritonserver"
    (root / "bin").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / "libnvinfer.so.10.7.0").write_bytes(b"")
    monkeypatch.setattr(tensorrt_check, "detect_compute_capability", lambda: None)
    install = TritonInstall(binary=root / "bin" / "tritonserver", backend_dir=root / "backends")
    with pytest.raises(TritonNotFound, match=r"cannot load the repository's TensorRT plans: model 'clf_model'.*10\.7\.0"):
        triton_command(install, TritonOptions(repository=repo))
    (root / "lib" / "libnvinfer.so.10.7.0").rename(root / "lib" / "libnvinfer.so.10.3.0")
    argv, _ = triton_command(install, TritonOptions(repository=repo))
    assert argv[0].endswith("tritonserver")


def test_export_with_tensorrt_writes_a_plan_entry_validated_like_the_onnx_variants(classifier_checkpoint, tmp_path,
                                                                                    monkeypatch):
    """The export's TensorRT wiring, with the GPU parts faked: the 'plan' is the ONNX graph run by ONNX
    Runtime, so the parity figures must come out exact and the entry must be a tensorrt_plan model."""
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.encoders.tensorrt_plan import TensorRTOptions

    built = {}
    _fake_tensorrt(monkeypatch, built, "TYPE_INT64")
    repo = tmp_path / "repo"
    texts = ["i love it", "terrible", "the box arrived", "great", "awful", "ok", "fine", "bad", "good"]
    result = export_encoder(classifier_checkpoint, "text-classification", EntryOptions("clf", target="gpu", max_batch_size=8),
                            repo, EncoderOptions(precision="int8", tensorrt=TensorRTOptions(calibration=texts, calibration_batch=4)))
    assert built["precision"] == "int8" and {"input_ids", "attention_mask"} <= set(built["inputs"])
    assert set(built["inputs"].values()) == {None}  # token inputs: [batch, seq] ranges
    assert [b["input_ids"].shape for b in built["calibration"]] == [(4, 128), (4, 128)]  # padded as served on GPUs
    assert built["profile"]["batch"] == {"min": 1, "opt": 8, "max": 8}
    assert result.parity["variant"] == "tensorrt-int8" and result.parity["outputs"]["logits"]["min_cosine"] > 0.999999
    config = (repo / "clf_model" / "config.pbtxt").read_text()
    assert 'platform: "tensorrt_plan"' in config and "KIND_GPU" in config and "10.3.0" in config
    assert (repo / "clf_model" / "1" / "model.plan").is_file() and not (repo / "clf_model" / "1" / "model.onnx").exists()
    assert json.loads((repo / "clf" / "rtxserve.json").read_text())["tensorrt"]["compute_capability"] == "8.9"


def test_export_with_tensorrt_checks_its_flags_before_any_work(classifier_checkpoint, tmp_path):
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.encoders.tensorrt_plan import TensorRTOptions
    from export.exceptions import ExportError

    cases = [
        (EntryOptions("m"), {}, "add --target gpu"),
        (EntryOptions("m", target="gpu"), {"optimize": True}, "drop --optimize"),
        (EntryOptions("m", target="gpu"), {"precision": "int8"}, "--calibration-texts"),
    ]
    for opts, kwargs, message in cases:
        with pytest.raises(ExportError, match=message):
            export_encoder(classifier_checkpoint, "text-classification", opts, tmp_path / "repo",
                           EncoderOptions(tensorrt=TensorRTOptions(), **kwargs))
    assert not (tmp_path / "repo").exists()


class _TinyYolo:
    """What Ultralytics' export step hands the YOLO export (export.detection.yolo.run_ultralytics), from a stand-in detector:
    one stride-32 convolution, images [B, 3, H, W] -> output0 [B, 4 + 2 classes, H/32 * W/32] (centre, size in
    pixels, class scores), exported to ONNX with dynamic batch and sides; its reference predictions are the served
    steps' own, so that this test holds the TensorRT wiring, not a model (test_yolo_e2e holds the real one)."""

    IMGSZ, STRIDE = 64, 32

    def __init__(self):
        import torch

        class Head(torch.nn.Module):
            def __init__(self, stride):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 6, stride, stride=stride)

            def forward(self, images):
                out = self.conv(images).flatten(2)
                return torch.cat([torch.sigmoid(out[:, :4]) * 64 + 8, torch.sigmoid(out[:, 4:])], 1)

        torch.manual_seed(0)
        self.module = Head(self.STRIDE).eval()

    def __call__(self, weights, images, settings, scratch):
        import torch

        from export.detection.yolo import served_detections
        from export.triton.python_models.image_preprocess import imaging

        inputs = [imaging.letterbox(image, self.IMGSZ, self.STRIDE)[None] for image in images]
        torch.onnx.export(self.module, (torch.from_numpy(inputs[0]),), str(scratch / "model.onnx"), input_names=["images"],
                          output_names=["output0"], dynamo=False,
                          dynamic_axes={"images": {0: "b", 2: "h", 3: "w"}, "output0": {0: "b", 2: "anchors"}})
        with torch.no_grad():
            outputs = [self.module(torch.from_numpy(x)).numpy() for x in inputs]
        np.savez(scratch / "reference.npz", **{f"input_{i}": x for i, x in enumerate(inputs)},
                 **{f"output_{i}": y for i, y in enumerate(outputs)})
        letterbox = {"imgsz": self.IMGSZ, "stride": self.STRIDE}
        found = served_detections(scratch / "model.onnx", images, letterbox, settings["conf"], settings["iou"],
                                  settings["max_det"])
        return {"imgsz": self.IMGSZ, "stride": self.STRIDE, "graph_nms": None, "names": {"0": "red", "1": "blue"},
                "predictions": [f.tolist() for f in found], "versions": {"ultralytics": "stand-in"}, "args": {}}


def _fake_tensorrt(monkeypatch, built: dict, input_type: str):
    """build_plan writes a 'plan' that only run_plan reads (anything that would parse it as ONNX fails, as on a real
    plan): run_plan runs the graph it was built from in ONNX Runtime, with its inputs of `input_type`, so the plan's
    parity comes out exact; what the export asked TensorRT for is recorded in `built`."""
    import onnxruntime as ort

    graphs = {}

    def fake_build(onnx_path, plan_path, *, inputs, profile, precision, calibration_feeds, workspace_gb):
        built.update(inputs=inputs, profile=profile.to_dict(), shapes=profile.shapes(inputs), precision=precision,
                     calibration=calibration_feeds)
        plan_path.write_bytes(b"a fake TensorRT engine")
        graphs[str(plan_path)] = onnx_path.read_bytes()
        return {"tensorrt_version": "10.3.0", "precision": precision, "profile": profile.to_dict(), "gpu": "fake",
                "compute_capability": "8.9", "build_seconds": 0.0, "inputs": {n: input_type for n in inputs},
                "calibration_batches": len(calibration_feeds or [])}

    def fake_run(plan_path, feeds):
        session = ort.InferenceSession(graphs[str(plan_path)], providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, dict(feeds))))

    monkeypatch.setattr(trt_export, "build_plan", fake_build)
    monkeypatch.setattr(trt_runtime, "run_plan", fake_run)


def _plan_served_as_the_graph_was(parity: dict, model_dir, precision: str):
    """The faked plan is the graph: its parity against PyTorch (on the same tensors), and its served answers against
    the framework's predict, are the graph's; it is the entry's model step on GPUs. Returns the step's config."""
    assert parity["variant"] == f"tensorrt-{precision}" and set(parity["variants"]) == {"fp32", f"tensorrt-{precision}"}
    assert parity["variants"][f"tensorrt-{precision}"]["outputs"] == parity["variants"]["fp32"]["outputs"]
    assert parity["served"]["passed"] and parity["served"]["detections"] > 0
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.platform == "tensorrt_plan" and config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    return config


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_yolo_plan_takes_every_letterbox_and_is_checked_and_served_as_the_graph_was(tmp_path, monkeypatch, precision):
    import export.detection.yolo as yolo
    from export.encoders.encoder import EncoderOptions
    from export.encoders.tensorrt_plan import TensorRTOptions
    from tests.integration import png

    built = {}
    _fake_tensorrt(monkeypatch, built, "TYPE_FP32")
    monkeypatch.setattr(yolo, "run_ultralytics", _TinyYolo())
    rng = np.random.default_rng(0)
    images = [png(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((48, 64), (64, 40), (30, 90), (64, 64))]
    repo = tmp_path / "repo"
    weights = tmp_path / "best.pt"
    weights.write_bytes(b"")
    trt = TensorRTOptions(calibration=images[:3], calibration_batch=2)
    written, parity, _ = yolo.export_yolo(weights, EntryOptions("det", target="gpu", max_batch_size=8), repo,
                                          EncoderOptions(precision=precision, sample_images=images, tensorrt=trt))
    assert built["precision"] == precision and built["inputs"] == {"images": (3, -1, -1)}
    # batches 1..8; each side from one stride (the narrowest letterbox) to imgsz
    assert built["shapes"] == {"images": ((1, 3, 32, 32), (8, 3, 64, 64), (8, 3, 64, 64))}
    if precision == "int8":  # 3 images in batches of 2: one full batch, each letterboxed to the whole square
        assert [f["images"].shape for f in built["calibration"]] == [(2, 3, 64, 64)]
        assert "calibrated on 2 images" in parity["variants"]["tensorrt-int8"]["notes"]
    else:
        assert built["calibration"] is None
    config = _plan_served_as_the_graph_was(parity, repo / "det_model", precision)
    assert [(i.name, list(i.dims)) for i in config.input] == [("images", [3, -1, -1])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("output0", [6, -1])]
    assert (repo / "det_model" / "1" / "model.plan").is_file() and not (repo / "det_model" / "1" / "model.onnx").exists()
    metadata = json.loads((repo / "det" / "rtxserve.json").read_text())
    assert metadata["tensorrt"]["profile"]["image_side"] == {"min": 32, "opt": 64, "max": 64}
    assert metadata["graph_activations"]["item_shape"] == [3, 64, 64]


@pytest.mark.parametrize("entry, options, message", [
    ({}, {}, "add --target gpu"),
    ({"target": "gpu"}, {"nms": True}, "drop --nms"),
    ({"target": "gpu"}, {"seq": "1,8,16"}, "--trt-seq is a token sequence range"),
    ({"target": "gpu"}, {"batch": "2,4,8"}, "--trt-batch min is 2"),
])
def test_a_yolo_plan_that_cannot_be_built_is_refused_before_any_work(tmp_path, monkeypatch, entry, options, message):
    import export.detection.yolo as yolo
    from export.encoders.encoder import EncoderOptions
    from export.encoders.tensorrt_plan import TensorRTOptions

    monkeypatch.setattr(yolo, "run_ultralytics", _TinyYolo())
    nms = options.pop("nms", False)
    with pytest.raises(ExportError, match=message):
        yolo.export_yolo(tmp_path / "best.pt", EntryOptions("det", max_batch_size=8, **entry), tmp_path / "repo",
                         EncoderOptions(nms=nms, tensorrt=TensorRTOptions(**options)))
    assert not (tmp_path / "repo").exists()


@pytest.fixture(scope="module")
def detr_checkpoint(tmp_path_factory):
    from fixture_models.detection import write_detector
    from tests.conftest import built_once

    # the integration tests' DETR, built once per run: its processor's shortest edge 64, longest 96
    return built_once(tmp_path_factory, "detr", write_detector)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_detr_plan_takes_every_size_its_resize_makes_and_is_checked_and_served_as_the_graph_was(
        detr_checkpoint, tmp_path, monkeypatch, precision):
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.encoders.tensorrt_plan import TensorRTOptions
    from export.triton.python_models.image_preprocess.imaging import Preprocess, ResizedAway
    from export.vision import sample_images
    from fixture_models.detection import probe_images
    from PIL import Image
    from tests.integration import png

    built = {}
    _fake_tensorrt(monkeypatch, built, "TYPE_FP32")
    rng = np.random.default_rng(0)
    calibration = [png(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((48, 64), (64, 40), (30, 90))]
    repo = tmp_path / "repo"
    # parity images: the probes, in each of which the fixture's build checked it has a detection, then the odd samples
    samples = [png(image) for image in probe_images()] + sample_images()
    export_encoder(detr_checkpoint, "object-detection", EntryOptions("detr", target="gpu", max_batch_size=4), repo,
                   EncoderOptions(precision=precision, sample_images=samples,
                                  tensorrt=TensorRTOptions(calibration=calibration, calibration_batch=2)))
    assert built["precision"] == precision and built["inputs"] == {"pixel_values": (3, -1, -1)}
    # batches 1..4; each side from 1 pixel (a sliver's short side) to the longest edge, optimised for a square's 64
    assert built["shapes"] == {"pixel_values": ((1, 3, 1, 1), (4, 3, 64, 64), (4, 3, 96, 96))}
    if precision == "int8":  # 3 images in batches of 2: one full batch, each image's centre square at 64 x 64
        assert [f["pixel_values"].shape for f in built["calibration"]] == [(2, 3, 64, 64)]
    else:
        assert built["calibration"] is None
    parity = json.loads((repo / "detr_model" / "parity.json").read_text())
    config = _plan_served_as_the_graph_was(parity, repo / "detr_model", precision)
    assert [(i.name, list(i.dims)) for i in config.input] == [("pixel_values", [3, -1, -1])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("logits", [8, 3]), ("pred_boxes", [8, 4])]
    metadata = json.loads((repo / "detr" / "rtxserve.json").read_text())
    assert metadata["tensorrt"]["profile"]["image_side"] == {"min": 1, "opt": 64, "max": 96}
    # sized on the graph the plan was built from, at the largest image the resize makes
    assert metadata["graph_activations"]["item_shape"] == [3, 64, 96]
    # The served pre-processing holds images to the plan's sides: a 1 x 100 sliver is already at its target short
    # side (DETR's rule rounds 96 / 100 up to 1), so it is not resized, and 100 would pass the plan's 96.
    pre = text_format.Parse((repo / "detr_preprocess" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    settings = json.loads(pre.parameters["image_processor"].string_value)
    sliver = Image.new("RGB", (100, 1))
    unbounded = {k: v for k, v in settings.items() if k != "max_side"}  # the ONNX graph's entry
    assert settings["max_side"] == 96 and Preprocess(unbounded).pixels(sliver).shape == (3, 1, 100)
    with pytest.raises(ResizedAway, match="over 96 pixels on a side, the most this model's TensorRT plan takes"):
        Preprocess(settings).pixels(sliver)

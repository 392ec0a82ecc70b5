"""The YOLO pieces that run without Ultralytics: the letterbox geometry, the NMS postprocess, and what an
Ultralytics checkpoint is refused for before its environment starts. Their agreement with Ultralytics' own
predict is held in tests/integration/test_yolo_e2e.py, on a trained fixture, through the real servers."""

import numpy as np
import pytest

from export.exceptions import ExportError
from export.triton.python_models.detection_postprocess.detections import yolo_detections, yolo_nms_detections
from export.triton.python_models.image_preprocess import imaging
from export.detection.yolo import check_task, ultralytics_checkpoint, validation_images


@pytest.mark.parametrize("size, expected", [
    ((480, 640), (240, 320, 8, 8, 0, 0)),  # landscape: 240 rows padded to 256 (the next multiple of 32)
    ((640, 480), (320, 240, 0, 0, 8, 8)),
    ((320, 320), (320, 320, 0, 0, 0, 0)),
    ((100, 50), (320, 160, 0, 0, 0, 0)),  # scaled up, as Ultralytics' predict does
    ((5, 7), (229, 320, 13, 14, 0, 0)),  # odd padding: one row more below, as LetterBox rounds dh -/+ 0.1
    ((1, 3000), (1, 320, 15, 16, 0, 0)),  # a sliver keeps at least one row (values read off Ultralytics 8.4.190)
])
def test_letterbox_geometry_is_ultralytics(size, expected):
    assert imaging.letterbox_geometry(*size, imgsz=320, stride=32) == expected


def test_letterbox_pads_grey_and_scales_to_0_1():
    image = np.full((480, 640, 3), 255, dtype=np.uint8)
    pixels = imaging.letterbox(image, 320, 32)
    assert pixels.shape == (3, 256, 320) and pixels.dtype == np.float32
    assert np.all(pixels[:, :8] == np.float32(114) / 255) and np.all(pixels[:, 8:248] == 1.0)


def test_a_letterbox_preprocess_follows_the_image():
    pre = imaging.Preprocess({"image_processor_type": "UltralyticsLetterBox", "letterbox": {"imgsz": 64, "stride": 32}})
    assert pre.shape == (3, -1, -1)
    with pytest.raises(ValueError, match="letterbox must be"):
        imaging.Preprocess({"letterbox": {"imgsz": 64}})


def _predictions(rows, classes=2, anchors=6):
    """[4 + classes, anchors] from (cx, cy, w, h, class, score) rows; other anchors score 0."""
    out = np.zeros((4 + classes, anchors), dtype=np.float32)
    for i, (cx, cy, w, h, c, score) in enumerate(rows):
        out[:4, i] = cx, cy, w, h
        out[4 + c, i] = score
    return out


def test_nms_is_per_class_best_first_and_bounded():
    rows = [(50, 50, 40, 40, 0, 0.9), (52, 50, 40, 40, 0, 0.8),  # same class, IoU ~0.9: the second goes
            (51, 50, 40, 40, 1, 0.7),  # another class at the same place: kept
            (200, 200, 20, 20, 0, 0.6), (10, 10, 4, 4, 1, 0.2)]  # far away; under conf 0.25
    found = yolo_detections(_predictions(rows), (320, 320), 320, 320, conf=0.25, iou=0.7, max_det=300)
    assert found[:, 4].tolist() == pytest.approx([0.9, 0.7, 0.6]) and found[:, 5].tolist() == [0, 1, 0]
    assert found[0, :4].tolist() == [30, 30, 70, 70]
    assert len(yolo_detections(_predictions(rows), (320, 320), 320, 320, conf=0.25, iou=0.7, max_det=2)) == 2
    loose = yolo_detections(_predictions(rows), (320, 320), 320, 320, conf=0.25, iou=0.95, max_det=300)
    assert len(loose) == 4  # at iou 0.95 the overlapping pair both stay


def test_boxes_leave_the_letterbox_into_the_image():
    # a 480x640 image letterboxed to 256x320 (scale 0.5, 8 rows of padding above): a box at (100, 58)-(140, 98)
    found = yolo_detections(_predictions([(120, 78, 40, 40, 0, 0.9)]), (256, 320), 480, 640, 0.25, 0.7, 300)
    assert found[0, :4].tolist() == [200, 100, 280, 180]
    clipped = yolo_detections(_predictions([(5, 10, 40, 40, 0, 0.9)]), (256, 320), 480, 640, 0.25, 0.7, 300)
    assert clipped[0, :2].tolist() == [0, 0]  # clipped to the image, as scale_boxes does


def test_a_graph_with_nms_in_it_is_filtered_cut_and_scaled_back():
    """Ultralytics' nms=True graph answers [max_det, 6] rows, the kept boxes then zero rows: those over the request's
    conf leave, best first, at most max_det, out of the letterbox as the postprocess step's NMS would send them."""
    rows = np.zeros((300, 6), dtype=np.float32)
    rows[:3] = [[100, 58, 140, 98, 0.6, 1], [100, 58, 140, 98, 0.9, 0], [0, 0, 10, 10, 0.2, 1]]
    found = yolo_nms_detections(rows, (256, 320), 480, 640, conf=0.25, max_det=300)
    assert found[:, 4].tolist() == pytest.approx([0.9, 0.6]) and found[:, 5].tolist() == [0, 1]
    assert found[0, :4].tolist() == [200, 100, 280, 180]  # as test_boxes_leave_the_letterbox_into_the_image's
    assert len(yolo_nms_detections(rows, (256, 320), 480, 640, conf=0.25, max_det=1)) == 1
    assert len(yolo_nms_detections(rows, (256, 320), 480, 640, conf=0.01, max_det=300)) == 3  # never the zero rows


def test_an_ultralytics_run_is_found_by_its_weights(tmp_path):
    assert ultralytics_checkpoint(tmp_path) is None  # a folder without args.yaml is a Hugging Face one
    (tmp_path / "args.yaml").write_text("task: detect\n")
    with pytest.raises(ExportError, match="without weights/best.pt"):
        ultralytics_checkpoint(tmp_path)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "last.pt").write_bytes(b"x")
    assert ultralytics_checkpoint(tmp_path) == tmp_path / "weights" / "last.pt"
    (tmp_path / "weights" / "best.pt").write_bytes(b"x")
    assert ultralytics_checkpoint(tmp_path) == tmp_path / "weights" / "best.pt"
    check_task(tmp_path / "weights" / "best.pt", "object-detection")
    with pytest.raises(ExportError, match="--task object-detection"):
        check_task(tmp_path / "weights" / "best.pt", "image-classification")


def test_parity_images_come_from_the_runs_validation_set(tmp_path):
    weights = tmp_path / "run" / "weights" / "best.pt"
    weights.parent.mkdir(parents=True)
    assert validation_images(weights) == []  # no args.yaml
    (tmp_path / "run" / "args.yaml").write_text(f"task: detect\ndata: {tmp_path / 'set' / 'data.yaml'}\n")
    assert validation_images(weights) == []  # its dataset is not on this machine
    val = tmp_path / "set" / "rel" / "images" / "val"
    val.mkdir(parents=True)
    for name in ("b.jpg", "a.PNG", "c.png", "notes.txt"):
        (val / name).write_bytes(b"x")
    (tmp_path / "set" / "data.yaml").write_text("path: rel\ntrain: images/train\nval: images/val\nnames: {0: a}\n")
    assert [p.name for p in validation_images(weights)] == ["a.PNG", "b.jpg", "c.png"]  # path: relative to the YAML
    assert [p.name for p in validation_images(weights, limit=2)] == ["a.PNG", "b.jpg"]
    (tmp_path / "set" / "data.yaml").write_text("path: rel\nval: [images/val, images/more]\n")
    assert validation_images(weights) == []  # a list of folders: the synthetic samples instead


@pytest.mark.parametrize("task", ["segment", "obb", "classify"])
def test_other_ultralytics_tasks_are_refused_before_any_work(tmp_path, task):
    (tmp_path / "args.yaml").write_text(f"task: {task}\nmodel: yolo11n-{task}.pt\n")
    with pytest.raises(ExportError, match=f"an Ultralytics {task} model .*not yet {task}"):
        check_task(tmp_path / "best.pt", "object-detection")


def test_without_the_ultralytics_environment_the_error_says_how_to_make_it(tmp_path, monkeypatch):
    from export.encoders.encoder import EncoderOptions
    from export.triton.entry import EntryOptions
    from export.detection.yolo import export_yolo

    monkeypatch.setenv("RTXSERVE_ENVS_DIR", str(tmp_path / "envs"))
    (tmp_path / "best.pt").write_bytes(b"x")
    with pytest.raises(ExportError, match="make setup-ultralytics"):
        export_yolo(tmp_path / "best.pt", EntryOptions(name="y"), tmp_path / "repo", EncoderOptions())
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())



@pytest.mark.parametrize("dims, refused", [(["batch", 300, 6], True), (["batch", 6, "anchors"], False)])
def test_an_end_to_end_yolo_is_named_not_misread(tmp_path, dims, refused):
    import onnx
    from onnx import TensorProto, helper

    from export.detection.yolo import _refuse_end_to_end

    graph = helper.make_graph([helper.make_node("Identity", ["images"], ["output0"])], "g",
                              [helper.make_tensor_value_info("images", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, dims)])
    onnx.save(helper.make_model(graph), tmp_path / "model.onnx")
    if refused:
        with pytest.raises(ExportError, match="end-to-end .*YOLO26 or YOLOv10"):
            _refuse_end_to_end(tmp_path / "model.onnx", tmp_path / "best.pt")
    else:
        _refuse_end_to_end(tmp_path / "model.onnx", tmp_path / "best.pt")

"""Through the real tritonserver and the gateway, with raw HTTP: the fixture YOLO (trained by Ultralytics from
random weights on generated rectangles, exported by Ultralytics' own exporter) answers /v1/detect as Ultralytics'
own `model.predict` does on the same images (same classes, box IoU >= 0.99, scores within 1e-3), with the
checkpoint's defaults, the request's conf / iou / max_det / classes, and bad input as a 400 that names it."""

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from export.detection.served import MIN_RECALL, SCORE_ATOL, compare_detections
from export.triton.python_models.image_preprocess import imaging
from export.vision import sample_images
from export.detection.yolo import PREDICT_DEFAULTS, run_ultralytics
from fixture_models.detection import YOLO_FLOOR

from .conftest import YOLO, yolo_images


def _detect(stack, images: list[bytes], **options) -> httpx.Response:
    return httpx.post(f"{stack.gateway_url}/v1/detect", timeout=60, json={
        "model": YOLO, "input": [{"image": base64.b64encode(i).decode()} for i in images], **options})


def _rows(response: httpx.Response) -> list[list[list[float]]]:
    assert response.status_code == 200, response.text
    return [[[*d["box"], d["score"], d["class_id"]] for d in image["detections"]] for image in response.json()["data"]]


@pytest.fixture(scope="module")
def predicted(stack, yolo_run, tmp_path_factory):
    """Ultralytics' own predict on the fixture's validation images and the odd sample images (sizes, EXIF, modes),
    at conf 0.01: (the images, its detections per image at predict's default iou, the same at iou 0.95). Less the
    16-bit grey gradient, which saturates this tiny model (see export.detection.yolo._default_samples)."""
    images = yolo_images(yolo_run) + sample_images(saturating=False)
    decoded = [np.asarray(imaging.decode(i)) for i in images]
    result = run_ultralytics(yolo_run / "weights" / "best.pt", decoded,
                             {"conf": 0.01, "iou": PREDICT_DEFAULTS["iou"], "max_det": PREDICT_DEFAULTS["max_det"],
                              "also": [{"iou": 0.95}]}, tmp_path_factory.mktemp("predict"))
    return images, result["predictions"], result["also"][0]


def _as_reference(rows):
    return [[(row[4], int(row[5]), row[:4]) for row in image] for image in rows]


def test_served_detections_are_ultralytics_predict(stack, yolo_run, predicted):
    images, reference, _ = predicted
    served = _rows(_detect(stack, images, conf=0.01))
    # the fixture finds a rectangle in each validation image, scoring YOLO_FLOOR or more (its build checked it)
    validation = len(yolo_images(yolo_run))
    assert all(max(row[4] for row in image) >= YOLO_FLOOR - SCORE_ATOL for image in served[:validation]), served
    check = compare_detections(served, _as_reference(reference), threshold=0.01)
    assert check["passed"] and check["detections"] >= validation, check


def test_defaults_are_the_checkpoints_and_options_apply_as_predicts(stack, predicted):
    images, reference, loose = predicted
    images, reference, loose = images[:8], reference[:8], loose[:8]
    confident = [[row for row in image if row[4] > PREDICT_DEFAULTS["conf"]] for image in reference]
    assert all(confident)  # the validation images: each has a rectangle scoring YOLO_FLOOR or more
    check = compare_detections(_rows(_detect(stack, images)), _as_reference(confident), threshold=PREDICT_DEFAULTS["conf"])
    assert check["passed"], check
    red = [[row for row in image if int(row[5]) == 0][:2] for image in reference]
    check = compare_detections(_rows(_detect(stack, images, conf=0.01, classes=[0], max_det=2)), _as_reference(red),
                               threshold=0.01)
    assert check["passed"], check
    # a looser NMS, as predict's at iou 0.95
    check = compare_detections(_rows(_detect(stack, images, conf=0.01, iou=0.95)), _as_reference(loose), threshold=0.01)
    assert check["passed"], check


def test_the_export_recorded_the_same_check(stack, yolo_run):
    repository = next(Path(a.split("=", 1)[1]) for a in stack.triton.command if a.startswith("--model-repository="))
    parity = json.loads((repository / f"{YOLO}_model" / "parity.json").read_text())
    # on the run's validation images: at least one detection in each
    served = parity["served"]
    assert parity["passed"] and served["passed"] and served["detections"] >= len(yolo_images(yolo_run)), parity
    assert parity["served"]["reference"].startswith("Ultralytics")
    # what `rtxserve plan` sizes the detector's activations from: its graph's live tensors at the largest letterbox,
    # each image's at least its own pixels
    graph = json.loads((repository / YOLO / "rtxserve.json").read_text())["graph_activations"]
    size = graph["item_shape"][1]
    assert graph["item_shape"] == [3, size, size] and graph["per_item_bytes"] >= 3 * size * size * 4, graph


def test_a_yolo_trained_too_briefly_is_refused_by_its_build(tmp_path):
    from fixture_models.detection import write_yolo
    from fixture_models.training import FixtureError

    with pytest.raises(FixtureError, match=r"did not learn that it finds a rectangle in each validation image.* in 1 "
                                           r"epochs \(1 runs of 1\)"):
        write_yolo(tmp_path / "yolo", epochs=1, seeds=1)


def test_bad_images_and_options_are_400s_that_name_them(stack, yolo_run):
    image = yolo_images(yolo_run)[0]
    r = _detect(stack, [image, image[:40]])
    assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
    r = _detect(stack, [image], iou=1.5)
    assert r.status_code == 422 and "iou" in r.text
    r = _detect(stack, [image], classes=[5])
    assert r.status_code == 400 and "classes" in r.json()["error"]["message"], r.text



def test_an_int8_export_is_calibrated_on_the_images_given_smaller_and_records_what_it_costs(yolo_run, tmp_path):
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.triton.entry import EntryOptions

    train = [p.read_bytes() for p in sorted((yolo_run.parent / "data" / "images" / "train").glob("*.png"))]
    result = export_encoder(yolo_run, "object-detection", EntryOptions(name="yolo_int8"), tmp_path / "repo",
                            EncoderOptions(precision="int8", sample_images=yolo_images(yolo_run), calibration_images=train))
    parity = result.parity
    assert f"calibrated on {len(train)} images" in parity["notes"]
    assert parity["variant"] == "int8" and parity["passed"] and parity["min_cosine"] == 0.95
    assert parity["outputs"]["scores"]["max_abs_diff"] > parity["variants"]["fp32"]["outputs"]["scores"]["max_abs_diff"]
    assert parity["served"]["recall"] >= MIN_RECALL["int8"] and parity["served"]["images"] == 8  # gated at export
    assert parity["served"]["recall_conf"] == PREDICT_DEFAULTS["conf"]
    # The graph's size, by its own weights (best.pt is no yardstick: Ultralytics' pickle carries the run's metrics,
    # which grow with the epochs trained): the convolutions but the head's hold int8 weights, and the file is about
    # half what its weights take in fp32 (0.53 for YOLO11n: the head, its scales and biases stay float).
    import numpy as np
    import onnx
    from onnx import numpy_helper

    path = next(p for p in result.entry if p.name == "yolo_int8_model") / "1" / "model.onnx"
    weights = [numpy_helper.to_array(w) for w in onnx.load(str(path)).graph.initializer]
    elements = sum(w.size for w in weights)
    assert sum(w.size for w in weights if w.dtype == np.int8) > 0.75 * elements
    assert path.stat().st_size < 0.6 * 4 * elements


def test_the_detect_load_test_drives_it(stack, yolo_run, tmp_path):
    """On the fixture's validation images as the dataset: the report's detections per image is the mean of what the
    gateway finds in the images sent, each of which holds one (the fixture's build checked it, at a floor above the
    checkpoint's default conf)."""
    from loadtest.runner import LoadSpec, run, scenario_options

    images = yolo_images(yolo_run)
    dataset = tmp_path / "images"
    dataset.mkdir()
    for i, image in enumerate(images):
        (dataset / f"{i}.png").write_bytes(image)
    found = [len(image["detections"]) for image in _detect(stack, images).json()["data"]]
    assert min(found) >= 1, found
    options = scenario_options(scenario="detect", model=YOLO, batch=2, dataset=str(dataset))
    s = run(LoadSpec(stack.gateway_url, options, users=2, duration_s=5, warmup_s=1), tmp_path / "report",
            log=lambda m: None).summary
    assert s.requests > 5 and s.errors == 0, s.error_kinds
    assert s.images["images"] == 2 * s.requests, s.images
    assert min(found) <= s.images["detections_per_image"] <= max(found), (s.images, found)

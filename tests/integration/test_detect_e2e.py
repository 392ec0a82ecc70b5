"""Through the real tritonserver and the gateway, with raw HTTP: the fixture DETR's, RT-DETR's and YOLOS' served detections
equal transformers' object-detection pipeline on the same images (same classes, box IoU >= 0.99, scores within 1e-3),
the export recorded the same check in parity.json, and bad input is a 400 that names it. A Conditional DETR (read as
RT-DETR is: a sigmoid per class, the best pairs) is held to the pipeline by its export's check."""

import base64
import io
import json

import httpx
import pytest

from export.detection.detr import PARITY_THRESHOLD, pipeline_detections
from export.detection.served import MIN_RECALL, compare_detections
from export.vision import sample_images
from fixture_models.detection import DETECTION_LABELS, probe_images

from . import png
from .conftest import DETECTOR, RT_DETR, YOLOS, detection_samples


def _detect(stack, images: list[bytes], model: str = DETECTOR, **options) -> httpx.Response:
    return httpx.post(f"{stack.gateway_url}/v1/detect", timeout=60, json={
        "model": model, "input": [{"image": base64.b64encode(i).decode()} for i in images], **options})


# The sample image YOLOS cannot take: 800x90, whose short side its resize to multiples of 16 leaves at 0 pixels.
SLIVER = 11


@pytest.mark.parametrize("model, checkpoint", [(DETECTOR, "detector_checkpoint"), (RT_DETR, "rt_detr_checkpoint"),
                                               (YOLOS, "yolos_checkpoint")])
def test_served_detections_are_the_pipelines(stack, model, checkpoint, request):
    samples = sample_images()  # odd sizes, EXIF, modes
    if model == YOLOS:
        r = _detect(stack, [samples[0], samples[SLIVER]], model)
        assert r.status_code == 400 and "image 1" in r.json()["error"]["message"] and \
            "multiples of 16" in r.json()["error"]["message"], r.text
        samples = samples[:SLIVER] + samples[SLIVER + 1:]
    images = [png(a) for a in probe_images()] + samples
    r = _detect(stack, images, model, conf=PARITY_THRESHOLD, max_det=1000)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    served = [[[*d["box"], d["score"], d["class_id"]] for d in image["detections"]] for image in data]
    assert all(served[:len(probe_images())])  # the fixture finds a rectangle in each probe (its build checked it)
    reference = pipeline_detections(request.getfixturevalue(checkpoint), images, PARITY_THRESHOLD)
    check = compare_detections(served, reference, PARITY_THRESHOLD)
    assert check["passed"], check
    from PIL import Image, ImageOps

    for image, data_ in zip(images, data):  # sizes as the image is shown (EXIF orientation applied)
        upright = ImageOps.exif_transpose(Image.open(io.BytesIO(image)))
        assert (data_["width"], data_["height"]) == upright.size


def test_the_export_recorded_the_same_check(stack):
    from pathlib import Path

    repository = next(Path(a.split("=", 1)[1]) for a in stack.triton.command if a.startswith("--model-repository="))
    served = json.loads((repository / f"{DETECTOR}_model" / "parity.json").read_text())["served"]
    # on the probes first (conftest.detection_samples): at least one detection in each
    assert served["passed"] and served["detections"] >= len(probe_images()), served
    # DETR keeps each image's aspect ratio: its largest input is the shortest edge by the longest (64 by 96)
    graph = json.loads((repository / DETECTOR / "rtxserve.json").read_text())["graph_activations"]
    assert graph["item_shape"] == [3, 64, 96] and graph["per_item_bytes"] >= 3 * 64 * 96 * 4, graph


def test_max_det_classes_and_bad_images(stack):
    image = png(probe_images()[0])
    one = _detect(stack, [image], conf=0.0, max_det=1).json()["data"][0]["detections"]
    assert len(one) == 1
    everything = _detect(stack, [image], conf=0.0, max_det=1000).json()["data"][0]["detections"]
    assert one[0] == everything[0] and len(everything) == 8  # the fixture's 8 queries, best first
    kept = 0
    for c, label in enumerate(DETECTION_LABELS):  # each class filter keeps exactly that class's share of the 8
        only = _detect(stack, [image], conf=0.0, classes=[c]).json()["data"][0]["detections"]
        assert only == [d for d in everything if d["class_id"] == c] and {d["label"] for d in only} <= {label}
        kept += len(only)
    assert kept == len(everything)
    r = _detect(stack, [image, image[:40]])
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("image 1: "), r.text
    r = _detect(stack, [image], conf=2)
    assert r.status_code == 422


def test_an_int8_export_records_what_it_costs_against_the_pipeline(detector_checkpoint, tmp_path):
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.triton.entry import EntryOptions

    result = export_encoder(detector_checkpoint, "object-detection", EntryOptions(name="detr_int8"), tmp_path / "repo",
                            EncoderOptions(precision="int8"))
    served = result.parity["served"]
    assert result.parity["variant"] == "int8" and served["recall"] >= MIN_RECALL["int8"]  # the export gates on it
    assert served["gate"] == f"recall {served['recall']:.3f} >= 0.9 at conf 0.5, box IoU 0.5"
    assert served["images"] == 13 and "min_box_iou" in served  # recorded whether or not it meets the fp32 bar


def test_a_conditional_detr_exports_with_the_pipelines_detections(tmp_path):
    """Read as RT-DETR is (a sigmoid per class), with its processor's top_k of 100 (query, class) pairs."""
    from export.encoders.encoder import EncoderOptions, export_encoder
    from export.triton.entry import EntryOptions
    from fixture_models.detection import write_detector

    checkpoint = write_detector(tmp_path / "conditional", model_type="conditional_detr")
    result = export_encoder(checkpoint, "object-detection", EntryOptions(name="conditional"), tmp_path / "repo",
                            EncoderOptions(sample_images=detection_samples()))
    served = result.parity["served"]
    assert served["passed"] and served["detections"] >= len(probe_images()), served
    config = (tmp_path / "repo" / "conditional_postprocess" / "config.pbtxt").read_text()
    assert '"top_k"' in config and '"100"' in config

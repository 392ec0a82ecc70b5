"""Object detection: the served pre- and post-processing against transformers' own code, and POST /v1/detect
in-process with a fake backend (options, bounds, the class filter, the Triton request it makes)."""

import asyncio
import base64
import dataclasses
import json

import numpy as np
import pytest
from PIL import Image
from fastapi.testclient import TestClient

from core.contract import MAX_DETECTIONS
from export.triton.python_models.detection_postprocess.detections import detr_detections, top_k_detections
from export.triton.python_models.image_preprocess.imaging import size_with_aspect_ratio, size_with_aspect_ratio_multiple
from serve.gateway.app import create_app
from serve.gateway.backends.base import Detections, ModelInfo
from serve.gateway.backends.triton import TritonBackend
from serve.gateway.settings import GatewaySettings

from .fakes import MODELS, FakeTriton, error_of, infer_response

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 20
DETECTOR = ModelInfo("boxes", "object-detection", "triton", True, ("cat", "dog", "car"), 4,
                     extra={"defaults": json.dumps({"conf": 0.4, "iou": 0.6, "max_det": 50})})
# x1 y1 x2 y2 score class, best first
ROWS = np.array([[1, 2, 30, 40, 0.9, 2], [5, 5, 9, 9, 0.8, 0], [0, 0, 3, 3, 0.5, 2]], dtype=np.float32)


@pytest.mark.parametrize("height, width", [(480, 640), (640, 480), (64, 64), (5, 7), (90, 800), (800, 90), (333, 334),
                                           (1000, 1333), (1333, 1000), (61, 83)])
@pytest.mark.parametrize("shortest, longest", [(800, 1333), (64, 96), (32, 32)])
def test_detr_resize_size_is_transformers(height, width, shortest, longest):
    from transformers.image_transforms import get_size_with_aspect_ratio

    assert size_with_aspect_ratio(height, width, shortest, longest) == \
        get_size_with_aspect_ratio((height, width), shortest, longest)


@pytest.mark.parametrize("height, width", [(480, 640), (640, 480), (64, 64), (5, 7), (90, 800), (800, 90), (333, 334),
                                           (1000, 1333), (1333, 1000), (61, 83), (64, 100), (100, 64), (97, 203)])
@pytest.mark.parametrize("shortest, longest", [(800, 1333), (64, 96), (512, 864)])
def test_yolos_resize_size_is_transformers(height, width, shortest, longest):
    from transformers.models.yolos.image_processing_pil_yolos import get_size_with_aspect_ratio_yolos

    assert size_with_aspect_ratio_multiple(height, width, shortest, longest, 16) == \
        get_size_with_aspect_ratio_yolos((height, width), shortest, longest)


def test_a_yolos_resize_that_leaves_no_pixels_is_refused_saying_so():
    from export.triton.python_models.image_preprocess.imaging import Preprocess, ResizedAway

    settings = {"image_processor_type": "YolosImageProcessor", "size": {"shortest_edge": 64, "longest_edge": 96},
                "size_multiple": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    with pytest.raises(ResizedAway, match="image is 800x90: resized to multiples of 16 pixels it keeps none"):
        Preprocess(settings).pixels(Image.new("RGB", (800, 90)))
    assert Preprocess(settings).pixels(Image.new("RGB", (800, 200))).shape == (3, 16, 96)


def _processors_answer(processor: str, seed: int):
    """Random logits and boxes (20 queries, 4 logit columns) and what `processor` (a transformers image processor,
    PIL backend, named under transformers.models) makes of them at threshold 0.3 for a 50x70 image."""
    import importlib
    from types import SimpleNamespace

    import torch

    module, name = processor.rsplit(".", 1)
    post = getattr(importlib.import_module(f"transformers.models.{module}"), name)().post_process_object_detection
    rng = np.random.default_rng(seed)
    logits, boxes = rng.normal(0, 2, (1, 20, 4)).astype(np.float32), rng.uniform(0.1, 0.6, (1, 20, 4)).astype(np.float32)
    (want,) = post(SimpleNamespace(logits=torch.from_numpy(logits), pred_boxes=torch.from_numpy(boxes)), threshold=0.3,
                   target_sizes=[(50, 70)])
    return logits[0], boxes[0], want


def test_detections_are_detrs_post_processing_sorted_and_capped():
    import torch

    logits, boxes, want = _processors_answer("detr.image_processing_pil_detr.DetrImageProcessorPil", 0)
    got = detr_detections(logits, boxes, 50, 70, 0.3, 1000)
    order = torch.argsort(want["scores"], descending=True, stable=True)
    assert len(got) == len(order) > 0
    np.testing.assert_allclose(got[:, 4], want["scores"][order].numpy(), atol=1e-6)
    np.testing.assert_array_equal(got[:, 5], want["labels"][order].numpy())
    np.testing.assert_allclose(got[:, :4], want["boxes"][order].numpy(), atol=1e-4)
    assert list(got[:, 4]) == sorted(got[:, 4], reverse=True)
    assert len(detr_detections(logits, boxes, 50, 70, 0.3, 2)) == 2


@pytest.mark.parametrize("processor, top_k", [("conditional_detr.image_processing_pil_conditional_detr."
                                                 "ConditionalDetrImageProcessorPil", 100),
                                                ("rt_detr.image_processing_pil_rt_detr.RTDetrImageProcessorPil", 20)])
def test_focal_loss_detections_are_the_image_processors_post_processing(processor, top_k):
    """Sigmoid per class, the best top_k (query, class) pairs (20 queries x 4 classes: RT-DETR's top_k, the query
    count, leaves pairs out; 100 keeps them all), a query answering for two classes where both score."""
    logits, boxes, want = _processors_answer(processor, 1)
    got = top_k_detections(logits, boxes, 50, 70, 0.3, 1000, top_k)
    assert len(got) == len(want["scores"]) > 0
    np.testing.assert_allclose(got[:, 4], want["scores"].numpy(), atol=1e-6)
    np.testing.assert_array_equal(got[:, 5], want["labels"].numpy())
    np.testing.assert_allclose(got[:, :4], want["boxes"].numpy(), atol=1e-4)
    assert len(top_k_detections(logits, boxes, 50, 70, 0.3, 2, top_k)) == 2


class FakeDetector(FakeTriton):
    def __init__(self, info: ModelInfo = DETECTOR):
        super().__init__(models=(*MODELS, info))
        self.options = []

    async def detect(self, model, images, options, timeout_s):
        self._record(images)
        self.options.append(tuple(options))
        return [Detections(ROWS[ROWS[:, 4] > options[0]][:options[2]], 70, 50) for _ in images]


@pytest.fixture
def detector():
    return FakeDetector()


@pytest.fixture
def dclient(detector):
    with TestClient(create_app(GatewaySettings(max_inputs=4, health_interval_s=60), [detector]),
                    raise_server_exceptions=False) as c:
        yield c


def _detect(client, **body):
    return client.post("/v1/detect", json={"model": "boxes", "input": [{"image": base64.b64encode(PNG).decode()}], **body})


def test_detections_come_back_per_image_with_labels_and_the_entrys_defaults(dclient, detector):
    r = _detect(dclient)
    assert r.status_code == 200, r.text
    (image,) = r.json()["data"]
    assert (image["index"], image["width"], image["height"]) == (0, 70, 50)
    assert [(d["label"], d["score"], d["box"]) for d in image["detections"]] == [
        ("car", pytest.approx(0.9), [1, 2, 30, 40]), ("cat", pytest.approx(0.8), [5, 5, 9, 9]),
        ("car", pytest.approx(0.5), [0, 0, 3, 3])]
    assert detector.options == [(0.4, 0.6, 50)]  # the entry's defaults, set at export
    assert detector.calls == [[PNG]]


def test_the_requests_options_and_class_filter_apply(dclient, detector):
    r = _detect(dclient, conf=0.6, iou=0.1, max_det=1)
    assert [d["class_id"] for d in r.json()["data"][0]["detections"]] == [2]
    assert detector.options == [(0.6, pytest.approx(0.1), 1)]
    r = _detect(dclient, conf=0.4, max_det=1, classes=[0])  # the filter first, then max_det
    assert [d["label"] for d in r.json()["data"][0]["detections"]] == ["cat"]
    assert detector.options[-1] == (0.4, pytest.approx(0.6), MAX_DETECTIONS)
    r = _detect(dclient, classes=[0])
    assert [d["label"] for d in r.json()["data"][0]["detections"]] == ["cat"]


@pytest.mark.parametrize("body, param", [({"conf": 1.5}, "conf"), ({"iou": -0.1}, "iou"),
                                         ({"max_det": MAX_DETECTIONS + 1}, "max_det"), ({"max_det": 0}, "max_det"),
                                         ({"classes": [-1]}, "classes"), ({"input": []}, "input")])
def test_options_out_of_bounds_are_refused(dclient, detector, body, param):
    r = _detect(dclient, **body)
    assert r.status_code == 422
    assert param in r.text
    assert detector.calls == []


@pytest.mark.parametrize("body, param", [({"conf": 0.005}, "conf"), ({"iou": 0.5}, "iou"), ({"max_det": 301}, "max_det")])
def test_a_model_with_nms_in_its_graph_refuses_what_its_graph_cannot_answer(body, param):
    """Exported with --nms: no box under the graph's conf floor leaves it, and its iou and max_det are fixed. A request
    asking otherwise is a 400 naming the option; one within them is answered."""
    graph_nms = {"conf": 0.01, "iou": 0.6, "max_det": 300}
    detector = FakeDetector(dataclasses.replace(DETECTOR, extra={"defaults": json.dumps(
        {"conf": 0.4, "iou": 0.6, "max_det": 50, "graph_nms": graph_nms})}))
    with TestClient(create_app(GatewaySettings(max_inputs=4, health_interval_s=60), [detector]),
                    raise_server_exceptions=False) as client:
        refused = _detect(client, **body)
        assert error_of(refused, 400)["param"] == param and "exported with --nms" in refused.text
        assert detector.calls == []
        assert _detect(client, conf=0.01, iou=0.6, max_det=300).status_code == 200


def test_an_unknown_class_an_undecodable_image_and_a_classifier_are_400s(dclient, detector):
    r = _detect(dclient, classes=[1, 7])
    assert "classes [7] do not exist" in error_of(r, 400)["message"]
    r = dclient.post("/v1/detect", json={"model": "boxes", "input": [{"image": base64.b64encode(PNG).decode()},
                                                                       {"image": base64.b64encode(b"GIF89a").decode()}]})
    assert "image 1 is not a PNG or JPEG file" in error_of(r, 400)["message"]
    r = dclient.post("/v1/detect", json={"model": "vit", "input": [{"image": base64.b64encode(PNG).decode()}]})
    assert "'vit' is a image-classification model, not object-detection" in error_of(r, 400)["message"]
    assert detector.calls == []


def test_the_triton_client_sends_each_image_with_its_options_and_drops_padding_rows():
    sent = []

    async def infer(request, timeout):
        sent.append(request)
        padded = np.concatenate([ROWS, np.full((2, 6), -1, np.float32)])[None]
        return infer_response(request, {"DETECTIONS": padded, "IMAGE_SIZE": np.array([[50, 70]], dtype=np.int64)})

    backend = TritonBackend("unused:1")
    backend._infer = infer
    found = asyncio.run(backend.detect(DETECTOR, [PNG, PNG], (0.25, 0.5, 10), 5.0))
    assert len(sent) == 2 and [i.name for i in sent[0].inputs] == ["IMAGE", "OPTIONS"]
    np.testing.assert_allclose(np.frombuffer(sent[0].raw_input_contents[1], dtype=np.float32), [0.25, 0.5, 10])
    assert [(f.width, f.height, len(f.rows)) for f in found] == [(70, 50, 3), (70, 50, 3)]


def test_detections_are_paired_by_class_score_and_box_not_by_rank():
    from export.detection.served import compare_detections

    reference = [[(1.0, 0, [0, 0, 10, 10]), (1.0, 0, [20, 20, 30, 30]), (0.5, 1, [5, 5, 15, 15])]]
    tied_swapped = [[[20, 20, 30, 30, 1.0, 0], [0, 0, 10, 10, 1.0, 0], [5, 5, 15, 15, 0.5, 1]]]
    assert compare_detections(tied_swapped, reference)["passed"]
    wrong_class = [[[0, 0, 10, 10, 1.0, 0], [20, 20, 30, 30, 1.0, 0], [5, 5, 15, 15, 0.5, 0]]]
    check = compare_detections(wrong_class, reference)
    assert not check["passed"] and "class 1" in check["detail"]
    moved = [[[0, 0, 10, 10, 1.0, 0], [20, 20, 30, 31, 1.0, 0], [5, 5, 15, 15, 0.5, 1]]]
    check = compare_detections(moved, reference)
    assert not check["passed"] and check["min_box_iou"] < 0.99
    assert "no served detection of class 0 scores within" in compare_detections([moved[0][:1]], reference)["detail"]
    extra = [[*tied_swapped[0], [40, 40, 50, 50, 0.9, 1]]]
    assert "1 served detection(s) the framework does not have" in compare_detections(extra, reference)["detail"]


def test_a_detection_at_the_cut_may_be_on_one_side_only():
    """Scored within SCORE_ATOL of the conf both sides were cut at, a detection may fall on either side of it in two
    engines; anything further from the cut must be on both."""
    from export.detection.served import SCORE_ATOL, compare_detections

    box = [0, 0, 10, 10]
    reference = [[(0.9, 0, box), (0.3 + SCORE_ATOL / 2, 1, [20, 20, 30, 30])]]
    served = [[[*box, 0.9, 0]]]
    assert not compare_detections(served, reference)["passed"]
    check = compare_detections(served, reference, threshold=0.3)
    assert check["passed"] and check["detections"] == 1, check
    assert compare_detections([[[*box, 0.9, 0], [40, 40, 50, 50, 0.3 + SCORE_ATOL / 2, 1]]], [[(0.9, 0, box)]],
                              threshold=0.3)["passed"]
    far = compare_detections([[[*box, 0.9, 0], [40, 40, 50, 50, 0.3 + 2 * SCORE_ATOL, 1]]], [[(0.9, 0, box)]],
                             threshold=0.3)
    assert not far["passed"] and "does not have" in far["detail"], far


def test_the_served_check_gates_fp32_and_records_a_lossy_variant():
    from export.detection.served import gate_served
    from export.exceptions import ExportError

    def differing():
        return {"passed": False, "detail": "image 0: 1 detections served, 2 from the framework",
                "reference": "Ultralytics 8.4.190 model.predict"}

    with pytest.raises(ExportError, match="differ from Ultralytics 8.4.190 model.predict: image 0"):
        gate_served(differing(), "fp32", allow_drift=False)
    assert "gate" not in gate_served(differing(), "fp32", allow_drift=True)
    assert gate_served(differing(), "int8", allow_drift=False)["gate"].startswith("none for int8")


def test_a_deformable_detr_is_refused_with_the_reason(tmp_path):
    """Its graph would be traced for one image size: refused before anything is exported."""
    import transformers

    from export.encoders.encoder import export_encoder
    from export.exceptions import ExportError
    from export.triton.entry import EntryOptions

    config = transformers.DeformableDetrConfig(num_queries=8, id2label={0: "a", 1: "b"}, label2id={"a": 0, "b": 1},
                                               architectures=["DeformableDetrForObjectDetection"])
    config.save_pretrained(tmp_path / "ckpt")
    transformers.DeformableDetrImageProcessor().save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ExportError, match="'deformable_detr' is not supported yet: .*traced for one image size"):
        export_encoder(tmp_path / "ckpt", "object-detection", EntryOptions(name="x"), tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_a_lossy_variant_is_gated_on_what_it_still_finds_at_the_default_conf():
    """Recall: of the framework's detections over the default conf, those a served one of the same class over it
    overlaps by RECALL_IOU; an int8 variant finding less than MIN_RECALL of them is refused unless drift is allowed."""
    from export.detection.served import MIN_RECALL, compare_detections, gate_served, recall
    from export.exceptions import ExportError

    reference = [[(0.9, 0, [0, 0, 10, 10]), (0.6, 1, [20, 20, 30, 30]), (0.2, 0, [40, 40, 50, 50])]] + \
        [[(0.8, 0, [0, 0, 10, 10])]] * 8
    kept = [[[1, 0, 11, 10, 0.7, 0], [20, 21, 30, 30, 0.55, 1]]] + [[[0, 0, 10, 10, 0.75, 0]]] * 8
    assert recall(kept, reference, 0.5) == 1.0  # scores moved, boxes a pixel off: everything found; 0.2 not asked
    lost = [[[1, 0, 11, 10, 0.7, 0], [20, 21, 30, 30, 0.45, 1]]] + [[[0, 0, 10, 10, 0.75, 0]]] * 7 + [[[0, 0, 10, 10, 0.8, 1]]]
    assert recall(lost, reference, 0.5) == 8 / 10  # one fell under the conf, one changed class
    assert recall([[[0, 0, 4, 10, 0.9, 0]]], [[(0.9, 0, [0, 0, 10, 10])]], 0.5) == 0.0  # IoU 0.4: not the same box
    assert recall([[]], [[(0.2, 0, [0, 0, 10, 10])]], 0.5) is None  # nothing over the conf to find

    served = compare_detections(kept, reference, 0.01, recall_conf=0.5) | {"reference": "predict"}
    assert gate_served(served, "int8", False)["gate"] == "recall 1.000 >= 0.9 at conf 0.5, box IoU 0.5"
    served = compare_detections(lost, reference, 0.01, recall_conf=0.5) | {"reference": "predict"}
    with pytest.raises(ExportError, match=r"the int8 variant finds 80.0% of the detections predict finds at conf 0.5"):
        gate_served(served, "int8", False)
    assert gate_served(served, "int8", True)["recall"] == 0.8 < MIN_RECALL["int8"]  # --allow-drift keeps it, recorded

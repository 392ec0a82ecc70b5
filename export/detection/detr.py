"""What a DETR-family object-detection export adds to the encoder pipeline: the model wrapped for its graph, how its
logits are read, and the check that the served steps answer as transformers' `pipeline("object-detection")` does
(recorded as `served` in parity.json).
"""

from __future__ import annotations

from pathlib import Path

from core.contract import DETECTION_DEFAULTS

from .served import compare_detections

# The DETR-family detectors (relative cx cy w h boxes, one per query), by how transformers reads their logits: with a
# trailing no-object class (DETR: softmax), or a sigmoid per class, the best `top_k` (query, class) pairs taken
# (trained with a focal loss: 100, their image processors' default, or every query, RT-DETR's).
DETR_FAMILY = {"detr": None, "conditional_detr": 100, "rt_detr": "queries", "rt_detr_v2": "queries",
               "yolos": None}  # YOLOS: a ViT whose detection tokens are DETR's queries, read as DETR's
# Known, and refused with the reason.
NOT_YET = {"deformable_detr": "Deformable DETR's graph is traced for one image size (its sampling offsets and level "
                              "shapes become constants), and its processor resizes each image to its own: the ONNX "
                              "graph answers other sizes wrongly (max abs logit diff 0.93 on the sample images)"}


def query_count(config: dict) -> int | None:
    """How many boxes the detector predicts per image: its queries (YOLOS' are its detection tokens)."""
    return config.get("num_detection_tokens") if config.get("model_type") == "yolos" else config.get("num_queries")


def top_k(config: dict) -> int | None:
    """How a checkpoint's logits are read (DETR_FAMILY): None for DETR's softmax, else the sigmoid's top_k."""
    k = DETR_FAMILY[config["model_type"]]
    return query_count(config) if k == "queries" else k


def detector(model):
    """A DETR-family detector as a module whose outputs are (logits, pred_boxes): what the graph returns."""
    import torch

    class Detector(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, pixel_values):  # no pixel_mask: one image per call, all of it real (DETR's default)
            out = self.model(pixel_values=pixel_values)
            return out.logits, out.pred_boxes

    return Detector(model)


# The score threshold at which the served detections are held to transformers' pipeline's (served.py): low enough that
# a briefly trained model finds something.
PARITY_THRESHOLD = 0.3


def pipeline_detections(checkpoint: Path, images: list[bytes], threshold: float) -> list[list[tuple]]:
    """transformers' object-detection pipeline on each image: (score, class id, [x1, y1, x2, y2]) best first, with
    the float boxes of its post-processing (the pipeline then rounds them to ints)."""
    import io

    import torch
    from PIL import Image
    from transformers import pipeline

    pipe = pipeline("object-detection", model=str(checkpoint), device="cpu")
    captured = []
    post = pipe.image_processor.post_process_object_detection

    def keep_floats(outputs, threshold, target_sizes):
        result = post(outputs, threshold=threshold, target_sizes=target_sizes)
        captured.extend(dict(r) for r in result)  # copies: the pipeline then replaces the tensors in place
        return result

    pipe.image_processor.post_process_object_detection = keep_floats
    found = []
    for data in images:
        captured.clear()
        with torch.no_grad():
            pipe(Image.open(io.BytesIO(data)), threshold=threshold)
        rows = zip(*(torch.as_tensor(captured[0][k]).tolist() for k in ("scores", "labels", "boxes")))
        found.append(sorted(rows, key=lambda d: -d[0]))
    return found


def detections_parity(model_path: Path, checkpoint: Path, inputs) -> dict:
    """The served steps (the pre-processing, the graph in ONNX Runtime or the TensorRT plan, the postprocess step's
    code) against transformers' object-detection pipeline on the sample images."""
    import json

    from ..tensorrt.runtime import session as served_session
    from ..triton.python_models.detection_postprocess.detections import detr_detections, top_k_detections
    from ..triton.python_models.image_preprocess.imaging import decode

    k = top_k(json.loads((checkpoint / "config.json").read_text()))
    session = served_session(model_path)
    served = []
    for data in inputs.samples:
        image = decode(data)
        logits, boxes = session.run(["logits", "pred_boxes"], {"pixel_values": inputs.preprocess.pixels(image)[None]})
        args = (logits[0], boxes[0], image.height, image.width, PARITY_THRESHOLD, 10**6)
        served.append(detr_detections(*args) if k is None else top_k_detections(*args, k))
    return {**compare_detections(served, pipeline_detections(checkpoint, inputs.samples, PARITY_THRESHOLD),
                                 PARITY_THRESHOLD, DETECTION_DEFAULTS["conf"]),
            "reference": "transformers pipeline('object-detection')", "threshold": PARITY_THRESHOLD}

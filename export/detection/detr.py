"""What an object-detection export adds: the DETR-family model wrapped for its graph, and the check that the
served steps answer as transformers' `pipeline("object-detection")` does (recorded as `served` in parity.json).
"""

from __future__ import annotations

from pathlib import Path

from ..exceptions import ExportError

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


# Where the served detections must agree with transformers' pipeline (the issue's bar): same class, score within
# 1e-3, box IoU at least 0.99. At a threshold low enough that a briefly trained model finds something.
PARITY_THRESHOLD, SCORE_ATOL, MIN_IOU = 0.3, 1e-3, 0.99


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


def compare_detections(served: list, reference: list[list[tuple]], threshold: float | None = None) -> dict:
    """Served detections (per image, rows of x1, y1, x2, y2, score, class id) against the framework's: each reference
    detection paired with a served one of its class whose score is within SCORE_ATOL, the one of highest box IoU
    (pairs are found this way rather than by rank: scores that tie to the last bit, as a saturated model's 1.0s do,
    may come in either order), each pair's IoU >= MIN_IOU, and none left over. With `threshold`, the conf both sides
    were cut at, a detection scoring within SCORE_ATOL of it may be on one side only: the engines' last bits decide
    which side of the cut it falls on."""
    near_cut = lambda score: threshold is not None and score < threshold + SCORE_ATOL  # noqa: E731
    worst_iou, worst_score, count, detail = 1.0, 0.0, 0, ""
    for i, (got, want) in enumerate(zip(served, reference)):
        free = [[float(v) for v in row] for row in got]
        for score, label, box in want:
            candidates = [row for row in free if int(row[5]) == label and abs(row[4] - score) <= SCORE_ATOL]
            if not candidates:
                if not near_cut(score):
                    near = min(free, key=lambda row: abs(row[4] - score), default=None)
                    if near is not None:
                        worst_score = max(worst_score, abs(near[4] - score))
                    detail = detail or (f"image {i}: no served detection of class {label} scores within {SCORE_ATOL} "
                                        f"of {score:.6f}" + (f" (nearest: class {int(near[5])}, {near[4]:.6f})"
                                                             if near is not None else " (none served)"))
                continue
            count += 1
            best = max(candidates, key=lambda row: _iou(box, row[:4]))
            free.remove(best)
            worst_score = max(worst_score, abs(best[4] - score))
            worst_iou = min(worst_iou, _iou(box, best[:4]))
        extra = [row for row in free if not near_cut(row[4])]
        if extra:
            detail = detail or (f"image {i}: {len(extra)} served detection(s) the framework does not have (the best "
                                f"class {int(extra[0][5])}, {extra[0][4]:.6f})")
    passed = not detail and worst_iou >= MIN_IOU and worst_score <= SCORE_ATOL
    if not detail and not passed:
        detail = f"worst box IoU {worst_iou:.4f} (needs >= {MIN_IOU}), worst score diff {worst_score:.2g} (<= {SCORE_ATOL})"
    return {"passed": passed, "detail": detail or "matched", "images": len(reference), "detections": count,
            "min_box_iou": round(worst_iou, 6), "max_score_diff": worst_score}


def gate_served(served: dict, precision: str, allow_drift: bool) -> dict:
    """The served-answers check as a gate: an fp32 export whose answers differ from the framework's fails (unless
    drift is allowed); a lossy variant is gated on min cosine instead, and these figures record what it costs."""
    if precision != "fp32":
        served["gate"] = f"none for {precision} (recorded; the variant is gated on min cosine)"
    elif not served["passed"] and not allow_drift:
        raise ExportError(f"the served answers differ from {served['reference']}: {served['detail']}")
    return served


def detections_parity(model_path: Path, checkpoint: Path, inputs) -> dict:
    """The served steps (the pre-processing, the graph in ONNX Runtime or the TensorRT plan, the postprocess step's
    code) against transformers' object-detection pipeline on the sample images."""
    import json

    from ..tensorrt.plan import session as served_session
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
                                 PARITY_THRESHOLD),
            "reference": "transformers pipeline('object-detection')", "threshold": PARITY_THRESHOLD}


def _iou(a, b) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else float(list(a) == list(b))

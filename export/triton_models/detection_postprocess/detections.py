"""A DETR-family detector's raw outputs -> boxes in the original image's pixels. NumPy only.

Copied beside `model.py` into `<name>_postprocess/1/` by `rtxserve export`; export imports it too (parity
against transformers' pipeline). It is what `post_process_object_detection` of DETR's image processors does:
softmax over the classes and the trailing no-object class, each query's best real class and its probability,
boxes from (centre x, centre y, width, height) relative to the image to (x1, y1, x2, y2) times the image's
width and height, queries kept whose score is over the threshold. Then, as a client expects of a detector
service: sorted by score, highest first, and at most `max_det` of them. DETR predicts a set (one query per
object), so there is no NMS.
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("x1", "y1", "x2", "y2", "score", "class_id")


def detr_detections(logits: np.ndarray, boxes: np.ndarray, height: int, width: int, conf: float,
                    max_det: int) -> np.ndarray:
    """One image's detections, float32 [n, 6] in COLUMNS order.

    Args:
        logits: [queries, classes + 1], the last column the no-object class.
        boxes: [queries, 4] (cx, cy, w, h) relative to the image.
        height, width: the image's size in pixels (as decoded and turned upright).
        conf: keep scores strictly over it (the pipeline's `threshold`).
        max_det: the most detections to keep (highest scores first).
    """
    logits = logits.astype(np.float32, copy=False)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = shifted / shifted.sum(axis=-1, keepdims=True)
    scores, classes = probs[:, :-1].max(axis=-1), probs[:, :-1].argmax(axis=-1)
    cx, cy, w, h = boxes.astype(np.float32, copy=False).T
    corners = np.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)
    corners = corners * np.array([width, height, width, height], dtype=np.float32)
    keep = np.flatnonzero(scores > conf)
    keep = keep[np.argsort(-scores[keep], kind="stable")][:max_det]
    return np.concatenate([corners[keep], scores[keep, None], classes[keep, None].astype(np.float32)], axis=1)

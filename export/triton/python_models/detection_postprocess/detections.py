"""A detector's raw outputs -> boxes in the original image's pixels. NumPy (and OpenCV's NMS for YOLO).

Three decoders: DETR's (`detr_detections`), that of the DETR-family detectors trained with a sigmoid focal loss
(Conditional DETR, Deformable DETR, RT-DETR: `top_k_detections`) and an Ultralytics YOLO's (`yolo_detections`).

Copied beside `model.py` into `<name>_postprocess/1/` by `rtxserve export`; export imports it too (parity
against transformers' pipeline). It is what `post_process_object_detection` of DETR's image processors does:
softmax over the classes and the trailing no-object class, each query's best real class and its probability,
boxes from (centre x, centre y, width, height) relative to the image to (x1, y1, x2, y2) times the image's
width and height, queries kept whose score is over the threshold. Then, as a client expects of a detector
service: sorted by score, highest first, and at most `max_det` of them. DETR predicts a set (one query per
object), so there is no NMS.

YOLO's is what Ultralytics' `non_max_suppression` and `scale_boxes` do for a detect model's predictions
[4 + classes, anchors] (centre x, centre y, width, height in the letterboxed tensor's pixels, then each class's
score): the best class per anchor, scores over `conf`, greedy class-aware NMS at `iou` (boxes of different
classes never suppress each other), at most `max_det` kept, boxes moved out of the letterbox into the image
and clipped to it.
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
    corners = _corners(boxes, height, width)
    keep = np.flatnonzero(scores > conf)
    keep = keep[np.argsort(-scores[keep], kind="stable")][:max_det]
    return np.concatenate([corners[keep], scores[keep, None], classes[keep, None].astype(np.float32)], axis=1)


def top_k_detections(logits: np.ndarray, boxes: np.ndarray, height: int, width: int, conf: float, max_det: int,
                     top_k: int) -> np.ndarray:
    """One image's detections, float32 [n, 6] in COLUMNS order, for a detector trained with a sigmoid focal loss:
    what `post_process_object_detection` of Conditional DETR's, Deformable DETR's and RT-DETR's image processors
    does. Each (query, class) pair's sigmoid is a candidate; the `top_k` best pairs are taken (a query may answer
    for two classes), kept when over `conf`, at most `max_det`, best first.

    Args:
        logits: [queries, classes], no no-object class.
        boxes: [queries, 4] (cx, cy, w, h) relative to the image.
        top_k: 100 for Conditional and Deformable DETR (their processors' default), the query count for RT-DETR.
    """
    logits = logits.astype(np.float32, copy=False)
    flat = (1.0 / (1.0 + np.exp(-logits))).reshape(-1)
    best = np.argsort(-flat, kind="stable")[:min(top_k, flat.size)]
    queries, classes = np.divmod(best, logits.shape[-1])
    keep = flat[best] > conf
    corners = _corners(boxes, height, width)[queries[keep]][:max_det]
    scores, classes = flat[best][keep][:max_det], classes[keep][:max_det]
    return np.concatenate([corners, scores[:, None], classes[:, None].astype(np.float32)], axis=1)


def _corners(boxes: np.ndarray, height: int, width: int) -> np.ndarray:
    """(cx, cy, w, h) relative to the image -> (x1, y1, x2, y2) in its pixels."""
    cx, cy, w, h = boxes.astype(np.float32, copy=False).T
    corners = np.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)
    return corners * np.array([width, height, width, height], dtype=np.float32)


# Ultralytics' non_max_suppression: at most this many candidates enter NMS, the best-scored.
MAX_NMS = 30_000


def yolo_detections(predictions: np.ndarray, letterboxed: tuple[int, int], height: int, width: int, conf: float,
                    iou: float, max_det: int) -> np.ndarray:
    """One image's detections, float32 [n, 6] in COLUMNS order, best first.

    Args:
        predictions: [4 + classes, anchors]: cx, cy, w, h in the letterboxed tensor's pixels, then class scores.
        letterboxed: the (height, width) of the tensor the model saw (imaging.letterbox_geometry).
        height, width: the image's size in pixels (as decoded and turned upright).
        conf: keep scores strictly over it.
        iou: suppress a box whose IoU with a better one of its class is over it.
        max_det: the most detections to keep.
    """
    x = predictions.astype(np.float32, copy=False).T
    scores_all = x[:, 4:]
    classes = scores_all.argmax(axis=1)
    scores = scores_all[np.arange(len(x)), classes]
    keep = np.flatnonzero(scores > conf)
    if keep.size > MAX_NMS:
        keep = keep[np.argsort(-scores[keep], kind="stable")[:MAX_NMS]]
    xy, half = x[keep, :2], x[keep, 2:4] / 2
    boxes, scores, classes = np.concatenate([xy - half, xy + half], axis=1), scores[keep], classes[keep]
    kept = _nms(boxes, scores, classes, iou)[:max_det]
    boxes = _unletterbox(boxes[kept], letterboxed, height, width)
    return np.concatenate([boxes, scores[kept, None], classes[kept, None].astype(np.float32)], axis=1)


def yolo_nms_detections(rows: np.ndarray, letterboxed: tuple[int, int], height: int, width: int, conf: float,
                        max_det: int) -> np.ndarray:
    """One image's detections from a graph with NMS in it (Ultralytics' nms=True), float32 [n, 6] in COLUMNS order,
    best first.

    Args:
        rows: [graph max_det, 6]: x1, y1, x2, y2 in the letterboxed tensor's pixels, score, class id; the graph's
            kept boxes, zero rows after them.
        conf: keep scores strictly over it (at least the graph's own floor: the gateway checks).
        max_det: the most detections to keep.
    """
    rows = rows.astype(np.float32, copy=False)
    rows = rows[rows[:, 4] > conf]
    rows = rows[np.argsort(-rows[:, 4], kind="stable")][:max_det]
    boxes = _unletterbox(rows[:, :4], letterboxed, height, width)
    return np.concatenate([boxes, rows[:, 4:6]], axis=1)


def _nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float) -> np.ndarray:
    """Greedy NMS per class (OpenCV's NMSBoxesBatched: boxes of different classes never suppress each other; the
    same boxes as torchvision's batched_nms keeps): indices kept, best score first."""
    import cv2

    if not len(boxes):
        return np.zeros(0, dtype=np.int64)
    xywh = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1)
    kept = np.asarray(cv2.dnn.NMSBoxesBatched(xywh.tolist(), scores.tolist(), classes.tolist(), 0.0, iou),
                      dtype=np.int64).reshape(-1)
    return kept[np.argsort(-scores[kept], kind="stable")]


def _unletterbox(boxes: np.ndarray, letterboxed: tuple[int, int], height: int, width: int) -> np.ndarray:
    """Ultralytics' scale_boxes: from the letterboxed tensor's pixels back to the image's, clipped to it."""
    gain = min(letterboxed[0] / height, letterboxed[1] / width)
    new_h, new_w = max(round(height * gain), 1), max(round(width * gain), 1)
    pad_x, pad_y = round((letterboxed[1] - new_w) / 2 - 0.1), round((letterboxed[0] - new_h) / 2 - 0.1)
    boxes = (boxes - np.array([pad_x, pad_y, pad_x, pad_y], dtype=np.float32)) / np.array(
        [new_w / width, new_h / height, new_w / width, new_h / height], dtype=np.float32)
    return np.clip(boxes, 0, np.array([width, height, width, height], dtype=np.float32)).astype(np.float32)

"""The served answers of a detector against the framework's own predict, for the DETR family (transformers' pipeline)
and Ultralytics YOLO (`model.predict`) alike: the figures recorded as `served` in parity.json, and the gate they pass.
"""

from __future__ import annotations

from ..exceptions import ExportError

# Where the served detections must agree with the framework's (the bar): same class, score within 1e-3, box IoU
# at least 0.99.
SCORE_ATOL, MIN_IOU = 1e-3, 0.99


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


def _iou(a, b) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else float(list(a) == list(b))

"""The served answers of a detector against the framework's own predict, for the DETR family (transformers' pipeline)
and Ultralytics YOLO (`model.predict`) alike: the figures recorded as `served` in parity.json, and the gate they pass.
"""

from __future__ import annotations

from ..exceptions import ExportError

# Where the served detections must agree with the framework's (the bar): same class, score within 1e-3, box IoU
# at least 0.99.
SCORE_ATOL, MIN_IOU = 1e-3, 0.99
# What a lossy variant must still find of what the framework finds at the model's own threshold (its default conf):
# a detection of the same class over that threshold whose box overlaps by RECALL_IOU (the loosest match COCO's mAP
# counts). Min cosine on the raw outputs cannot say it: a score that drifts below the threshold is a detection lost.
# An int8 detector that drops more than one in ten of them is not the model that was trained; fp16 drops none.
RECALL_IOU = 0.5
MIN_RECALL = {"int8": 0.9, "fp16": 0.99}


def compare_detections(served: list, reference: list[list[tuple]], threshold: float | None = None,
                       recall_conf: float | None = None) -> dict:
    """Served detections (per image, rows of x1, y1, x2, y2, score, class id) against the framework's: each reference
    detection paired with a served one of its class whose score is within SCORE_ATOL, the one of highest box IoU
    (pairs are found this way rather than by rank: scores that tie to the last bit, as a saturated model's 1.0s do,
    may come in either order), each pair's IoU >= MIN_IOU, and none left over. With `threshold`, the conf both sides
    were cut at, a detection scoring within SCORE_ATOL of it may be on one side only: the engines' last bits decide
    which side of the cut it falls on. With `recall_conf` (the model's default conf), what the served answers find of
    the framework's detections over it (`recall`) too."""
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
    found = {"passed": passed, "detail": detail or "matched", "images": len(reference), "detections": count,
             "min_box_iou": round(worst_iou, 6), "max_score_diff": worst_score}
    if recall_conf is not None:
        found |= {"recall": recall(served, reference, recall_conf), "recall_conf": recall_conf}
    return found


def recall(served: list, reference: list[list[tuple]], conf: float) -> float | None:
    """The share of the framework's detections scoring `conf` or more that the served ones (rows as in
    compare_detections) find: one of the same class scoring `conf` or more whose box overlaps by RECALL_IOU, each
    served detection taken once; None where the framework finds nothing."""
    wanted = hit = 0
    for got, want in zip(served, reference):
        free = [[float(v) for v in row] for row in got if float(row[4]) >= conf]
        for score, label, box in sorted(want, key=lambda d: -d[0]):
            if score < conf:
                continue
            wanted += 1
            matches = [row for row in free if int(row[5]) == label and _iou(box, row[:4]) >= RECALL_IOU]
            if matches:
                hit += 1
                free.remove(max(matches, key=lambda row: _iou(box, row[:4])))
    return hit / wanted if wanted else None


def gate_served(served: dict, precision: str, allow_drift: bool) -> dict:
    """The served-answers check as a gate: an fp32 export whose answers differ from the framework's fails (unless
    drift is allowed); a lossy variant's answers differ by design, and it fails when it finds less than MIN_RECALL
    of the framework's detections at the model's default conf (unless drift is allowed); the figures record what
    it costs."""
    if precision != "fp32":
        found, floor = served.get("recall"), MIN_RECALL[precision]
        if found is None:
            served["gate"] = f"none for {precision}: the framework finds nothing over the default conf in the samples"
            return served
        served["gate"] = f"recall {found:.3f} >= {floor} at conf {served['recall_conf']:g}, box IoU {RECALL_IOU}"
        if found < floor and not allow_drift:
            raise ExportError(f"the {precision} variant finds {found:.1%} of the detections {served['reference']} finds "
                              f"at conf {served['recall_conf']:g} (needs {floor:.0%}): export it as fp32 or fp16, "
                              "calibrate it on more images like those it will see, or pass --allow-drift to keep it")
    elif not served["passed"] and not allow_drift:
        raise ExportError(f"the served answers differ from {served['reference']}: {served['detail']}")
    return served


def _iou(a, b) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else float(list(a) == list(b))

"""POST /v1/detect logic, testable without a server."""

from __future__ import annotations

import json

from core.contract import DETECTION_DEFAULTS, MAX_DETECTIONS, OBJECT_DETECTION

from ..exceptions import InvalidRequest
from ..inputs.images import CANARY_IMAGE, decode_images
from ..state import GatewayState
from .protocol import Detection, DetectRequest, DetectResponse, ImageDetections

TASK = OBJECT_DETECTION


def options(defaults: dict, request: DetectRequest) -> tuple[float, float, int]:
    """(conf, iou, max_det): the request's, else the entry's defaults (set at export), else ours. A model exported
    with NMS in its graph (`graph_nms` in its defaults) keeps no box under its conf floor, and its iou and max_det are
    fixed: a request that asks otherwise is refused, naming the option, rather than answered as it did not ask."""
    chosen = {}
    for key, ours in DETECTION_DEFAULTS.items():
        given = getattr(request, key)
        chosen[key] = given if given is not None else defaults.get(key, ours)
    conf, iou, max_det = float(chosen["conf"]), float(chosen["iou"]), int(chosen["max_det"])
    graph = defaults.get("graph_nms")
    if graph:
        fixed = "this model's NMS is in its graph (exported with --nms)"
        if conf < graph["conf"]:
            raise InvalidRequest(f"conf {conf:g}: {fixed}, which keeps no box scoring under {graph['conf']:g}",
                                 param="conf")
        if request.iou is not None and request.iou != graph["iou"]:
            raise InvalidRequest(f"iou {request.iou:g}: {fixed}, at iou {graph['iou']:g}; leave iou out",
                                 param="iou")
        if max_det > graph["max_det"]:
            raise InvalidRequest(f"max_det {max_det}: {fixed}, which keeps at most {graph['max_det']} boxes",
                                 param="max_det")
    return conf, iou, max_det


async def detect(state: GatewayState, request: DetectRequest) -> DetectResponse:
    limits = state.settings
    info = await state.dispatch.resolve(request.model, TASK)
    encoded = decode_images(state.settings, request.input)
    labels = info.labels
    unknown = sorted({c for c in request.classes or () if c >= len(labels)})
    if unknown:
        raise InvalidRequest(f"model {info.name!r} has {len(labels)} classes (ids 0-{len(labels) - 1}); "
                             f"classes {unknown} do not exist", param="classes")
    conf, iou, max_det = options(json.loads(info.extra.get("defaults") or "{}"), request)
    wanted = set(request.classes) if request.classes else None
    # The class filter comes before max_det (as Ultralytics' classes= does): ask for all, cut after filtering.
    asked = (conf, iou, MAX_DETECTIONS if wanted else max_det)
    results = await state.dispatch.call(info, lambda b, m: b.detect(m, encoded, asked, limits.request_timeout_s))
    data = []
    for i, found in enumerate(results):
        rows = [row for row in found.rows if wanted is None or int(row[5]) in wanted][:max_det]
        # Boxes to 1e-5 pixel, as Ultralytics' Results.summary writes them (0.01 cost a box of a pixel or two its IoU)
        detections = [Detection(box=[round(float(v), 5) for v in row[:4]], score=float(row[4]), class_id=int(row[5]),
                                label=labels[int(row[5])] if int(row[5]) < len(labels) else str(int(row[5])))
                      for row in rows]
        data.append(ImageDetections(index=i, width=found.width, height=found.height, detections=detections))
    return DetectResponse(model=info.name, data=data)


# Deep readiness (state.py): the first request each model answers before it takes traffic.
_CANARY_OPTIONS = (DETECTION_DEFAULTS["conf"], DETECTION_DEFAULTS["iou"], DETECTION_DEFAULTS["max_det"])
CANARIES = {TASK: lambda backend, model, timeout: backend.detect(model, [CANARY_IMAGE], _CANARY_OPTIONS, timeout)}

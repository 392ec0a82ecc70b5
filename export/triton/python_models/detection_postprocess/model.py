"""Triton python-backend model: a detector's outputs -> each image's detections.

Copied into `<name>_postprocess/1/model.py` by `rtxserve export`, with `detections.py` (and, for YOLO, `imaging.py`)
beside it. The string parameter `decoder` says whose outputs these are:
  detr: logits [batch, queries, classes + 1] FP32, pred_boxes [batch, queries, 4] FP32;
  top_k: logits [batch, queries, classes] FP32 (sigmoid per class), pred_boxes as DETR's; parameter `top_k`, the
        (query, class) pairs considered (Conditional / Deformable DETR, RT-DETR);
  yolo: output0 [batch, 4 + classes, anchors] FP32, in the letterboxed tensor's pixels (parameter `letterbox`:
        {"imgsz", "stride"}, as the preprocess step's, to find where the image lay in it);
  yolo_nms: output0 [batch, max_det, 6] FP32 from a graph with NMS in it (x1, y1, x2, y2 in the letterboxed
        tensor's pixels, score, class id), parameter `letterbox` as yolo's.
Inputs besides: image_size [batch, 2] INT64 (height, width), OPTIONS [batch, 3] FP32 (conf, iou, max_det: the
request's; iou is for YOLO's NMS, DETR has none).
Outputs: DETECTIONS [batch, n, 6] FP32 (x1, y1, x2, y2 in the image's pixels, score, class id), best first.
A request carries one image (the ensemble's images are not resized to one size), so n is that image's count.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path[:1]:
    sys.path.insert(0, _HERE)

import detections  # noqa: E402

DECODERS = ("detr", "top_k", "yolo", "yolo_nms")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.decoder = params.get("decoder", "detr")
        if self.decoder not in DECODERS:
            raise pb_utils.TritonModelException(f"detection postprocess: decoder must be one of {DECODERS}, "
                                                f"got {self.decoder!r}")
        if self.decoder == "top_k":
            self.top_k = int(params["top_k"])
        if self.decoder in ("yolo", "yolo_nms"):
            import imaging  # the preprocess step's own geometry, so that boxes leave the letterbox as they entered

            letterbox = json.loads(params["letterbox"])
            self.geometry = lambda h, w: imaging.letterbox_geometry(h, w, letterbox["imgsz"], letterbox["stride"])

    def _detections(self, request, sizes, options):
        if self.decoder not in ("yolo", "yolo_nms"):
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
            boxes = pb_utils.get_input_tensor_by_name(request, "pred_boxes").as_numpy()
            decode = (detections.detr_detections if self.decoder == "detr" else
                      lambda *args: detections.top_k_detections(*args, self.top_k))
            return [decode(logits[i], boxes[i], int(sizes[i, 0]), int(sizes[i, 1]), float(options[i, 0]),
                           int(options[i, 2])) for i in range(len(sizes))]
        predictions = pb_utils.get_input_tensor_by_name(request, "output0").as_numpy()
        found = []
        for i in range(len(sizes)):
            height, width = int(sizes[i, 0]), int(sizes[i, 1])
            new_h, new_w, top, bottom, left, right = self.geometry(height, width)
            letterboxed = (new_h + top + bottom, new_w + left + right)
            if self.decoder == "yolo_nms":
                found.append(detections.yolo_nms_detections(predictions[i], letterboxed, height, width,
                                                            float(options[i, 0]), int(options[i, 2])))
            else:
                found.append(detections.yolo_detections(predictions[i], letterboxed, height, width,
                                                        float(options[i, 0]), float(options[i, 1]), int(options[i, 2])))
        return found

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                sizes = pb_utils.get_input_tensor_by_name(request, "image_size").as_numpy()
                options = pb_utils.get_input_tensor_by_name(request, "OPTIONS").as_numpy()
                found = self._detections(request, sizes, options)
                most = max(len(f) for f in found)
                # One image per request in practice; rows of a batch are padded with score -1 to one length.
                out = np.full((len(found), most, 6), -1.0, dtype=np.float32)
                for i, f in enumerate(found):
                    out[i, :len(f)] = f
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("DETECTIONS", out)]))
            except Exception as exc:  # a bug or resource problem of ours: log the cause, fail only this request
                pb_utils.Logger.log_error(f"detection postprocess: unexpected {type(exc).__name__}: {exc}")
                error = pb_utils.TritonError(f"detection postprocess: internal error ({type(exc).__name__})")
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

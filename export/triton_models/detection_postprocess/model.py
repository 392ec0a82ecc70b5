"""Triton python-backend model: a DETR-family detector's outputs -> each image's detections.

Copied into `<name>_postprocess/1/model.py` by `rtxserve export`, with `detections.py` beside it.
Inputs:  logits [batch, queries, classes + 1] FP32, pred_boxes [batch, queries, 4] FP32, image_size [batch, 2]
         INT64 (height, width), OPTIONS [batch, 3] FP32 (conf, iou, max_det: the request's; iou is for detectors
         with NMS and unused here).
Outputs: DETECTIONS [batch, n, 6] FP32 (x1, y1, x2, y2 in the image's pixels, score, class id), best first.
A request carries one image (the ensemble's images are not resized to one size), so n is that image's count.
"""

import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path[:1]:
    sys.path.insert(0, _HERE)

import detections  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        pass

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
                boxes = pb_utils.get_input_tensor_by_name(request, "pred_boxes").as_numpy()
                sizes = pb_utils.get_input_tensor_by_name(request, "image_size").as_numpy()
                options = pb_utils.get_input_tensor_by_name(request, "OPTIONS").as_numpy()
                found = [detections.detr_detections(logits[i], boxes[i], int(sizes[i, 0]), int(sizes[i, 1]),
                                                    float(options[i, 0]), int(options[i, 2]))
                         for i in range(len(logits))]
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

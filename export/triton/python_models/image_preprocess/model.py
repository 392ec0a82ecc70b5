"""Triton python-backend model: encoded PNG/JPEG bytes -> pixel values for a vision classifier or detector.

Copied into `<name>_preprocess/1/model.py` by `rtxserve export`, with `imaging.py` beside it. The
checkpoint's image-processor settings arrive as JSON in the string parameter `image_processor`
(written by export/vision.py: read_image_processor).
Inputs:  IMAGE [batch, 1] BYTES (the raw file bytes).   Outputs: pixel_values [batch, 3, H, W] FP32, and where
the config asks for it image_size [batch, 2] INT64 (each image's height and width once upright: a detector's
boxes are scaled to it). Where H and W follow the image (DETR), a request carries one image.
An undecodable, non-PNG/JPEG or oversized image fails its own request with INVALID_ARG; the other
requests of the batch are answered normally.
"""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub appends this version folder to sys.path before importing model.py; putting it first as
# well keeps an installed package that happens to be named `imaging` from shadowing ours.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path[:1]:
    sys.path.insert(0, _HERE)

import imaging  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if "image_processor" not in params:
            raise pb_utils.TritonModelException("image preprocess model: parameter 'image_processor' is missing")
        try:
            self.preprocess = imaging.Preprocess(json.loads(params["image_processor"]))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError too
            raise pb_utils.TritonModelException(f"image preprocess model: bad 'image_processor' parameter: {exc}")
        inputs = {i["name"]: i for i in config["input"]}
        if set(inputs) != {"IMAGE"} or inputs["IMAGE"]["data_type"] != "TYPE_STRING":
            raise pb_utils.TritonModelException(
                f"image preprocess model: expects one TYPE_STRING input IMAGE, config has {sorted(inputs)}"
            )
        outputs = {o["name"]: o for o in config["output"]}
        dims = [int(d) for d in outputs.get("pixel_values", {}).get("dims", [])]
        if set(outputs) - {"image_size"} != {"pixel_values"} or dims != list(self.preprocess.shape):
            raise pb_utils.TritonModelException(
                f"image preprocess model: outputs must be pixel_values {list(self.preprocess.shape)} (and image_size), "
                f"config has {sorted(outputs)} {dims}"
            )
        self.sizes = "image_size" in outputs
        # Pillow's own guard (warning above the limit, error above twice it) agrees with ours, which
        # refuses anything over the limit from the header before decoding (this process is ours alone).
        imaging.Image.MAX_IMAGE_PIXELS = self.preprocess.max_pixels

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)
                images = [imaging.decode(data, self.preprocess.max_pixels) for data in raw]
                pixels = np.stack([self.preprocess.pixels(image) for image in images]).astype(np.float32, copy=False)
                tensors = [pb_utils.Tensor("pixel_values", pixels)]
                if self.sizes:
                    sizes = np.array([[image.height, image.width] for image in images], dtype=np.int64)
                    tensors.append(pb_utils.Tensor("image_size", sizes))
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except ValueError as exc:  # the client's image: not PNG/JPEG, corrupt, too large
                error = pb_utils.TritonError(f"image preprocess: {exc}", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            except Exception as exc:  # a bug or resource problem of ours: log the cause, fail only this request
                pb_utils.Logger.log_error(f"image preprocess: unexpected {type(exc).__name__}: {exc}")
                error = pb_utils.TritonError(f"image preprocess: internal error ({type(exc).__name__})")
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

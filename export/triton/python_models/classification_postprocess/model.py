"""Triton python-backend model: classifier logits -> probabilities, top label and its score.

Inputs:  LOGITS [batch, num_labels] FP32.
Outputs: PROBS [batch, num_labels] FP32, LABEL [batch, 1] BYTES, SCORE [batch, 1] FP32.
Softmax for single-label models; sigmoid when problem_type is multi_label_classification.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        if "labels" not in params:
            raise pb_utils.TritonModelException("postprocess model: parameter 'labels' is missing")
        self.labels = np.array([s.encode("utf-8") for s in json.loads(params["labels"])], dtype=object)
        self.multi_label = params.get("problem_type") == "multi_label_classification"

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy().astype(np.float32)
            if logits.shape[-1] != len(self.labels):
                error = pb_utils.TritonError(
                    f"postprocess: {logits.shape[-1]} logits for {len(self.labels)} labels"
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            if self.multi_label:
                probs = 1.0 / (1.0 + np.exp(-logits))
            else:
                shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
                probs = shifted / shifted.sum(axis=-1, keepdims=True)
            top = probs.argmax(axis=-1)
            tensors = [
                pb_utils.Tensor("PROBS", probs.astype(np.float32)),
                pb_utils.Tensor("LABEL", self.labels[top].reshape(-1, 1)),
                pb_utils.Tensor("SCORE", probs[np.arange(len(top)), top].reshape(-1, 1).astype(np.float32)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

"""Triton python-backend model: UTF-8 texts -> token id tensors for an encoder model.

Copied into `<name>_tokenizer/1/model.py` by `rtxserve export`, beside the checkpoint's
`tokenizer.json`. Texts longer than the model's maximum length are truncated (max_length parameter).
Inputs:  TEXT [batch, 1] BYTES.   Outputs: the names in the `output_names` parameter, INT64 [batch, seq].
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        for key in ("max_length", "output_names", "pad_token_id"):
            if key not in params:
                raise pb_utils.TritonModelException(f"tokenizer model: parameter '{key}' is missing")
        self.output_names = json.loads(params["output_names"])
        declared = {o["name"] for o in config["output"]}
        if set(self.output_names) != declared:
            raise pb_utils.TritonModelException(
                f"tokenizer model: outputs {sorted(declared)} do not match output_names {self.output_names}"
            )
        path = os.path.join(args["model_repository"], args["model_version"], "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        max_length = int(params["max_length"])
        self.tokenizer.enable_truncation(max_length=max_length)
        # "longest" pads each request to its longest text (CPU, python backend batches itself);
        # "max_length" gives fixed shapes, which native GPU backends and TensorRT profiles need.
        length = max_length if params.get("padding", "longest") == "max_length" else None
        self.tokenizer.enable_padding(pad_id=int(params["pad_token_id"]), length=length)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
                texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw]
                encodings = self.tokenizer.encode_batch(texts)
                arrays = {
                    "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                    "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                    "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
                }
                tensors = [pb_utils.Tensor(name, arrays[name]) for name in self.output_names]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not fail the others in the batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tokenizer: {exc}")))
        return responses

"""Triton python-backend model: runs `model.onnx` with ONNX Runtime on the CPU.

The CPU form of an exported encoder (the GPU form uses Triton's native onnxruntime / TensorRT
backends instead). Dynamic batching hands several requests to one `execute` call: their token
sequences are padded to the longest (attention mask 0), images are stacked, and the whole runs as
one batch, then is split back per request.
Outputs whose first non-batch dim is -1 are per-token and are cut back to each request's length.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        options = ort.SessionOptions()
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        threads = int(params.get("intra_op_threads", "0"))
        # Several instances share the cores: by default split them instead of oversubscribing.
        options.intra_op_num_threads = threads or max(1, (os.cpu_count() or 1) // instances)
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.input_names = [i["name"] for i in config["input"]]
        self.outputs = [(o["name"], o["dims"][0] == -1) for o in config["output"]]
        onnx_inputs = {i.name for i in self.session.get_inputs()}
        if onnx_inputs != set(self.input_names):
            raise pb_utils.TritonModelException(
                f"config inputs {sorted(self.input_names)} do not match model.onnx inputs {sorted(onnx_inputs)}"
            )

    def execute(self, requests):
        try:
            feeds_per_request = [
                {n: pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.input_names}
                for r in requests
            ]
            results = self._run(feeds_per_request)
        except Exception as exc:
            error = pb_utils.TritonError(f"onnxruntime: {exc}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        return [pb_utils.InferenceResponse(output_tensors=tensors) for tensors in results]

    def _run(self, feeds_per_request):
        first = self.input_names[0]
        batch_sizes = [f[first].shape[0] for f in feeds_per_request]
        # Token tensors [batch, seq] differ in seq between requests: pad to the longest (mask 0).
        # Fixed-shape inputs (images [batch, 3, H, W]) concatenate as they are.
        seq_lens = [f[first].shape[1] if f[first].ndim == 2 else 0 for f in feeds_per_request]
        longest = max(seq_lens)
        feeds = {
            name: np.concatenate(
                [np.pad(f[name], ((0, 0), (0, longest - f[name].shape[1]))) if f[name].ndim == 2 else f[name]
                 for f in feeds_per_request]
            )
            for name in self.input_names
        }
        names = [name for name, _ in self.outputs]
        outputs = dict(zip(names, self.session.run(names, feeds)))
        results, start = [], 0
        for size, seq in zip(batch_sizes, seq_lens):
            tensors = []
            for name, per_token in self.outputs:
                part = outputs[name][start : start + size]
                if per_token:
                    part = part[:, :seq]
                tensors.append(pb_utils.Tensor(name, np.ascontiguousarray(part)))
            results.append(tensors)
            start += size
        return results

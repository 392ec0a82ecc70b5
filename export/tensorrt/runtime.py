"""Running a built TensorRT plan on GPU 0, for the parity checks an export makes: the engine loaded once per file
version, `run_plan` (name -> output array), and `session`, which gives a plan (or, for any other file, ONNX Runtime on
the CPU) the `session.run(names, feeds)` that the checks call, so a plan is checked as its graph is. Building the plan
is plan.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..exceptions import ExportError
from .plan import NUMPY_TYPES, dtype_name, import_tensorrt, tensorrt_logger


@functools.lru_cache(maxsize=2)
def _engine(path: str, mtime: float):
    """(tensorrt, error list, logger, runtime, engine) of a plan file, loaded once per file version: a parity
    check runs many cases. The logger and runtime are kept because they must outlive the engine."""
    trt = import_tensorrt()
    errors: list[str] = []
    logger = tensorrt_logger(trt, errors)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
    if engine is None:
        raise ExportError(f"TensorRT {trt.__version__} cannot load {path}: {'; '.join(errors) or 'unknown error'}")
    return trt, errors, logger, runtime, engine


def run_plan(plan_path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a plan on GPU 0 (for parity checks against ONNX Runtime / PyTorch): name -> output array."""
    import torch

    trt, errors, _, _, engine = _engine(str(plan_path), Path(plan_path).stat().st_mtime)
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    kept, outputs = [], {}
    for name in names:
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            dtype = NUMPY_TYPES[dtype_name(trt, engine.get_tensor_dtype(name))]
            tensor = torch.from_numpy(np.ascontiguousarray(feeds[name], dtype=dtype)).cuda()
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, int(tensor.data_ptr()))
            kept.append(tensor)
    for name in names:
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            dtype = NUMPY_TYPES[dtype_name(trt, engine.get_tensor_dtype(name))]
            tensor = torch.from_numpy(np.empty(tuple(context.get_tensor_shape(name)), dtype=dtype)).cuda()
            context.set_tensor_address(name, int(tensor.data_ptr()))
            outputs[name] = tensor
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise ExportError(f"TensorRT failed to run {plan_path}: {'; '.join(errors) or 'unknown error'}")
    stream.synchronize()
    return {name: t.cpu().numpy() for name, t in outputs.items()}


class PlanSession:
    """ONNX Runtime's `session.run(names, feeds)` over a TensorRT plan: a plan checked as a graph is."""

    def __init__(self, plan: Path):
        self.plan = plan

    def run(self, names: Sequence[str] | None, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        outputs = run_plan(self.plan, feeds)
        return [outputs[n].astype(np.float32) for n in (names or outputs)]


def session(path: Path):
    """What runs the served model file at `path` for a parity check, as ONNX Runtime's `session.run(names, feeds)`:
    TensorRT on GPU 0 for a plan (model.plan), else ONNX Runtime on the CPU."""
    if Path(path).suffix == ".plan":
        return PlanSession(Path(path))
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

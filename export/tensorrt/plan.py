"""ONNX -> TensorRT plan (optimisation profile, FP16 / INT8) and its `tensorrt_plan` Triton model.

Builds run only on a machine with an NVIDIA GPU and the `tensorrt` package (10.x). A plan loads only in
the TensorRT version that built it, on GPUs of the compute capability it was built for: both go in the
model's `tensorrt.json` and config parameters, where `rtxserve serve triton` checks them before start.
TensorRT 10 keeps ONNX INT64 inputs as INT64, so the tokenizer model's INT64 tensors feed the plan as is. Running
a built plan for parity checks is runtime.py's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core import contract

from ..exceptions import ExportError
from ..triton.entry import EntryOptions, ModelDir, gpu_model_config
from ..triton.model_config import TensorSpec
from ..variants import PRECISIONS

log = logging.getLogger(__name__)

BATCH_FLAG, SEQ_FLAG = "--trt-batch", "--trt-seq"  # the CLI flags the profile comes from (named in errors)
TOKEN_DATA_TYPE = "TYPE_INT64"  # token tensors stay INT64 end to end with TensorRT >= 10
MIN_MAJOR = 10
Shape = tuple[int, ...]
_TRITON_TYPES = {"FLOAT": "TYPE_FP32", "HALF": "TYPE_FP16", "INT8": "TYPE_INT8", "UINT8": "TYPE_UINT8",
                 "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL"}
NUMPY_TYPES = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32,
                "INT64": np.int64, "BOOL": np.bool_}


def _range(flag: str, spec: str) -> tuple[int, int, int]:
    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) not in (1, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{flag} {spec!r}: use MIN,OPT,MAX as positive integers (e.g. 1,8,32), or one integer for a fixed size")
    return tuple(int(p) for p in parts) * (3 if len(parts) == 1 else 1)  # type: ignore[return-value]


def _check_order(flag: str, values: tuple[int, int, int]) -> None:
    if len(values) != 3 or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{flag}: need three positive integers MIN,OPT,MAX, got {values}")
    if not values[0] <= values[1] <= values[2]:
        raise ValueError(f"{flag} {','.join(map(str, values))}: need MIN <= OPT <= MAX")


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimisation profile: (min, opt, max) of the batch, of the sequence for token inputs, and of
    an image's height and width for image inputs whose size follows the image (a YOLO's letterbox: (3, -1, -1)).

    Inputs with fixed non-batch dims (pixel_values (3, H, W)) take only the batch range.
    """

    batch: tuple[int, int, int]
    seq: tuple[int, int, int] | None = None
    side: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        _check_order(BATCH_FLAG, self.batch)
        if self.seq is not None:
            _check_order(SEQ_FLAG, self.seq)
        if self.side is not None:
            _check_order("image side", self.side)

    @classmethod
    def parse(cls, batch: str | None = None, seq: str | None = None, *, max_batch_size: int,
              max_length: int | None = None) -> "Profile":
        """The profile from flag values "MIN,OPT,MAX"; defaults: batch 1,B,B and sequence 1,L,L.

        Args:
            batch: batch range; MIN must be 1 and MAX the entry's max_batch_size (B).
            seq: sequence range for token inputs; MAX at most the entry's max length (L).
            max_batch_size: the entry's --max-batch-size.
            max_length: the entry's max length; None for models without token inputs (no sequence range).

        Raises:
            ValueError: a malformed or out-of-range value, naming the flag and what to pass.
        """
        b = _range(BATCH_FLAG, batch) if batch is not None else (1, max_batch_size, max_batch_size)
        # Triton's dynamic batcher sends batches of 1 .. max_batch_size: a plan must take all of them
        # (Triton refuses to load a plan whose largest batch is below the config's max_batch_size).
        if b[0] != 1:
            raise ValueError(f"{BATCH_FLAG} min is {b[0]}: it must be 1, since the dynamic batcher sends single requests too")
        if b[2] != max_batch_size:
            raise ValueError(f"{BATCH_FLAG} max is {b[2]}: it must equal --max-batch-size {max_batch_size} "
                             "(change --max-batch-size to serve smaller batches)")
        s = _range(SEQ_FLAG, seq) if seq is not None else None if max_length is None else (1, max_length, max_length)
        if s is not None and max_length is not None and s[2] > max_length:
            raise ValueError(f"{SEQ_FLAG} max {s[2]} exceeds the entry's max length {max_length} (--max-length)")
        return cls(b, s)  # __post_init__ checks MIN <= OPT <= MAX

    def shapes(self, inputs: Mapping[str, Shape | None] | Sequence[str]) -> dict[str, tuple[Shape, Shape, Shape]]:
        """(min, opt, max) shape per input: [batch, seq] for token inputs (None or a bare name), [batch, *dims]
        otherwise, each -1 of dims (an image's height or width) taken from the side range."""
        specs = dict(inputs) if isinstance(inputs, Mapping) else {name: None for name in inputs}
        out = {}
        for name, dims in specs.items():
            if dims is None:
                if self.seq is None:
                    raise ValueError(f"input {name!r} is a token input but the profile has no sequence range: pass {SEQ_FLAG}")
                out[name] = tuple((b, s) for b, s in zip(self.batch, self.seq))
            else:
                if not dims or any(int(d) < 1 and int(d) != -1 for d in dims):
                    raise ValueError(f"input {name!r}: dims must be positive (or -1 for a side that varies), got {tuple(dims)}")
                if -1 in map(int, dims) and self.side is None:
                    raise ValueError(f"input {name!r} has sides that vary {tuple(dims)} but the profile has no side range")
                sides = self.side or (None, None, None)
                out[name] = tuple((b, *(s if int(d) == -1 else int(d) for d in dims)) for b, s in zip(self.batch, sides))
        return out  # type: ignore[return-value]

    def to_dict(self) -> dict:
        def r(v):
            return None if v is None else dict(zip(("min", "opt", "max"), v))
        return {"batch": r(self.batch), "sequence": r(self.seq)} | ({"image_side": r(self.side)} if self.side else {})


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise ExportError(
            "TensorRT builds need a GPU machine with the `tensorrt` package (pip install tensorrt-cu12, or run in the "
            "NGC TensorRT / Triton container); without it, `--target gpu` without --tensorrt serves the ONNX graph "
            f"with Triton's native onnxruntime backend ({exc})"
        ) from exc
    major = int(str(trt.__version__).split(".")[0])
    if major < MIN_MAJOR:
        raise ExportError(f"TensorRT {trt.__version__} is too old: rtxserve builds plans with TensorRT {MIN_MAJOR}.x "
                          "(INT64 token inputs); pip install -U tensorrt-cu12")
    return trt


def _gpu() -> tuple[str, str]:
    """(name, compute capability "8.9") of the CUDA device TensorRT builds for; ExportError without one."""
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        raise ExportError("no CUDA device is visible to PyTorch: a TensorRT plan is built (and checked) on the GPU model "
                          "that will serve it; run the export on the serving box with a CUDA build of torch, or use "
                          "`--target gpu` without --tensorrt")
    major, minor = torch.cuda.get_device_capability(0)
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def dtype_name(trt, dtype) -> str:
    for name in _TRITON_TYPES:
        if getattr(trt.DataType, name, None) == dtype:
            return name
    raise ExportError(f"TensorRT data type {dtype} has no Triton equivalent")


def tensorrt_logger(trt, errors: list[str]):
    class Logger(trt.ILogger):
        """TensorRT's messages into our log; errors kept for the exception message."""

        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)
            else:
                log.debug("TensorRT: %s", msg)

    return Logger()


def _progress_monitor(trt):
    """Top-level build phases as log lines (TensorRT >= 10 has IProgressMonitor); None where absent."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.t0 = time.perf_counter()

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                log.info("  TensorRT: %s (%d steps, %.0fs in)", phase_name, num_steps, time.perf_counter() - self.t0)

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            pass

    return Monitor()


def full_batches(items: list, batch: int) -> list[list]:
    """`items` in batches of min(batch, len(items)), the incomplete tail dropped: TensorRT calibrates at one shape
    (the text, image and YOLO calibration batches are cut with it)."""
    size = min(batch, len(items))
    return [items[i:i + size] for i in range(0, len(items) - size + 1, size)]


def _calibrator(trt, feeds: list[dict[str, np.ndarray]], dtypes: dict[str, type], cache: Path | None):
    """Entropy calibrator that copies each feed to the GPU (torch CUDA tensors) when TensorRT asks for it."""
    import torch

    class Calibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            trt.IInt8EntropyCalibrator2.__init__(self)
            self.index, self.on_gpu = 0, []

        def get_batch_size(self):
            return int(next(iter(feeds[0].values())).shape[0])

        def get_batch(self, names):
            if self.index >= len(feeds):
                return None
            feed = feeds[self.index]
            self.index += 1
            # Kept on self: the memory must live until TensorRT asks for the next batch.
            self.on_gpu = [torch.from_numpy(np.ascontiguousarray(feed[n], dtype=dtypes[n])).cuda() for n in names]
            return [int(t.data_ptr()) for t in self.on_gpu]

        def read_calibration_cache(self):
            return cache.read_bytes() if cache is not None and cache.is_file() else None

        def write_calibration_cache(self, data):
            if cache is not None:
                cache.write_bytes(bytes(data))

    return Calibrator()


def _calibration_shapes(feeds: list[dict[str, np.ndarray]], names: list[str], profile: dict) -> dict[str, Shape]:
    """The one shape per input that every calibration batch has (TensorRT calibrates at one shape)."""
    shapes = {}
    for name in names:
        seen = {tuple(f[name].shape) for f in feeds if name in f}
        if len(seen) != 1 or any(name not in f for f in feeds):
            raise ExportError(f"calibration batches must all hold {name!r} with one shape, got {sorted(seen)}: pad every "
                              "batch to the same length (and use the same batch size)")
        shape = seen.pop()
        low, _, high = profile[name]
        if len(shape) != len(low) or any(not lo <= d <= hi for d, lo, hi in zip(shape, low, high)):
            raise ExportError(f"calibration batches of {name!r} have shape {shape}, outside the profile {low}..{high}")
        shapes[name] = shape
    return shapes


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    *,
    inputs: Mapping[str, Shape | None],
    profile: Profile,
    precision: str = "fp16",
    calibration_feeds: list[dict[str, np.ndarray]] | None = None,
    workspace_gb: float = 4.0,
    calibration_cache: Path | None = None,
) -> dict:
    """Build a TensorRT plan from an ONNX graph for the GPU of this machine (takes minutes).

    Args:
        onnx_path: a plain ONNX graph (not ONNX Runtime's fused or quantised forms: their contrib ops do not parse).
        plan_path: where to write the serialised engine.
        inputs: graph input name -> fixed non-batch dims (pixel_values (3, H, W)), -1 for a side the image sets
            (images (3, -1, -1): the profile's side range), or None for a token input [batch, seq].
        profile: the optimisation profile.
        precision: fp32, fp16, or int8 (INT8 where it pays, FP16 elsewhere; needs `calibration_feeds`).
        calibration_feeds: INT8 calibration batches, name -> array, every batch of one shape inside the profile.
        workspace_gb: TensorRT's workspace memory pool limit.
        calibration_cache: read (if present) and written by the INT8 calibrator.

    Returns:
        what was built: tensorrt_version, precision, profile, gpu, compute_capability, build_seconds,
        inputs (name -> Triton data type), calibration_batches.

    Raises:
        ExportError: no TensorRT or GPU, an ONNX graph TensorRT cannot parse, bad calibration data, a failed build.
    """
    if precision not in PRECISIONS:
        raise ExportError(f"unknown TensorRT precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision == "int8" and not calibration_feeds:
        raise ExportError("INT8 TensorRT builds calibrate on sample inputs: pass --calibration-texts FILE (one text per "
                          "line; --calibration-images DIR for vision models), or build fp16")
    shapes = profile.shapes(inputs)
    fixed = _calibration_shapes(calibration_feeds, list(inputs), shapes) if precision == "int8" else {}
    trt = import_tensorrt()
    gpu, capability = _gpu()
    _check_precision(trt, precision)
    errors: list[str] = []
    logger = tensorrt_logger(trt, errors)
    builder = trt.Builder(logger)
    network, dtypes = _parse(trt, builder, logger, errors, onnx_path, inputs)
    config = _builder_config(trt, builder, shapes, precision, workspace_gb)
    # A local keeps the calibrator's Python object alive for as long as TensorRT calls into it.
    calibrator = (_calibrate(trt, builder, config, fixed, calibration_feeds, {n: NUMPY_TYPES[dtypes[n]] for n in inputs},
                             calibration_cache) if precision == "int8" else None)
    monitor = _progress_monitor(trt)
    if monitor is not None:
        config.progress_monitor = monitor

    log.info("building the TensorRT %s engine for %s (compute capability %s), profile %s; this takes minutes",
             precision, gpu, capability, json.dumps(profile.to_dict()))
    seconds = _build(builder, network, config, plan_path, errors)
    del calibrator
    return {
        "tensorrt_version": str(trt.__version__),
        "precision": precision,
        "profile": profile.to_dict() | {"shapes": {n: [list(s) for s in v] for n, v in shapes.items()}},
        "gpu": gpu,
        "compute_capability": capability,
        "build_seconds": round(seconds, 1),
        "inputs": {n: _TRITON_TYPES[d] for n, d in dtypes.items()},
        "calibration_batches": len(calibration_feeds) if precision == "int8" else 0,
    }


def _builder_config(trt, builder, shapes: dict[str, tuple[Shape, Shape, Shape]], precision: str, workspace_gb: float):
    """The build's config: the workspace limit, the one optimisation profile, and FP16 for fp16 and int8 builds."""
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    trt_profile = builder.create_optimization_profile()
    for name, (low, opt, high) in shapes.items():
        trt_profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(trt_profile)
    if precision in ("fp16", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)  # INT8 builds keep FP16 for layers without a faster INT8 kernel
    return config


def _check_precision(trt, precision: str) -> None:
    """Refuse a precision this TensorRT cannot build (weakly typed FP16 / INT8 and calibration are TensorRT 10's)."""
    if precision != "fp32" and not hasattr(trt.BuilderFlag, "FP16"):
        raise ExportError(f"TensorRT {trt.__version__} has no weakly typed FP16 / INT8 builds: use TensorRT 10.x for {precision}")
    if precision == "int8" and not hasattr(trt, "IInt8EntropyCalibrator2"):
        raise ExportError(f"TensorRT {trt.__version__} dropped calibration-based INT8: use TensorRT 10.x, or fp16")


def _parse(trt, builder, logger, errors: list[str], onnx_path: Path, inputs: Mapping[str, Shape | None]) -> tuple:
    """The network parsed from the ONNX graph, and its inputs' TensorRT data type names; the inputs must be the entry's."""
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    log.info("parsing %s for TensorRT %s", onnx_path, trt.__version__)
    if not parser.parse_from_file(str(onnx_path)):
        details = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "; ".join(errors)
        raise ExportError(f"TensorRT cannot parse {onnx_path.name}: {details} (build from the plain fp32 ONNX graph, "
                          "not the --optimize / ONNX Runtime --precision forms)")
    graph_inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    if set(graph_inputs) != set(inputs):
        raise ExportError(f"the ONNX graph's inputs {sorted(graph_inputs)} differ from the entry's {sorted(inputs)}")
    return network, {name: dtype_name(trt, t.dtype) for name, t in graph_inputs.items()}


def _calibrate(trt, builder, config, fixed: dict[str, Shape], feeds: list[dict[str, np.ndarray]], dtypes: dict,
               cache: Path | None):
    """INT8 on `config`, calibrated at the batches' one shape; returns the calibrator (keep it until the build ends)."""
    config.set_flag(trt.BuilderFlag.INT8)
    calib_profile = builder.create_optimization_profile()
    for name, shape in fixed.items():
        calib_profile.set_shape(name, shape, shape, shape)
    config.set_calibration_profile(calib_profile)
    calibrator = _calibrator(trt, feeds, dtypes, cache)
    config.int8_calibrator = calibrator
    return calibrator


def _build(builder, network, config, plan_path: Path, errors: list[str]) -> float:
    """Build and write the serialised engine; returns the build's seconds."""
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    if serialized is None:
        hint = "; ".join(errors[-3:]) or "see the TensorRT messages above"
        raise ExportError(f"TensorRT could not build the engine after {seconds:.0f}s: {hint} "
                          "(raise --workspace-gb if it ran out of memory)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    with open(plan_path, "wb") as f:
        f.write(serialized)
    log.info("built %s in %.1fs (%.1f MB)", plan_path.name, seconds, plan_path.stat().st_size / 1e6)
    return seconds


def tensorrt_model(opts: EntryOptions, plan_path: Path, inputs: Mapping[str, Shape | None] | Sequence[str],
                   outputs: tuple[TensorSpec, ...], parity: dict, info: dict) -> ModelDir:
    """The `<name>_model` step of an entry as a native `tensorrt_plan` model on KIND_GPU instances.

    Args:
        opts: the entry's options (target gpu).
        plan_path: the plan `build_plan` wrote.
        inputs: as for `build_plan` (a list of names: all token inputs).
        outputs: the graph's outputs, as for the ONNX model.
        parity: the plan's parity report.
        info: what `build_plan` returned; recorded in tensorrt.json and the config's parameters.
    """
    if opts.target != "gpu":
        raise ValueError("TensorRT plans are served on GPUs: use --target gpu with --tensorrt")
    batch_max = ((info.get("profile") or {}).get("batch") or {}).get("max", opts.max_batch_size)
    if batch_max < opts.max_batch_size:
        raise ValueError(f"the plan takes batches up to {batch_max} but the entry's max batch size is {opts.max_batch_size}: "
                         "Triton would refuse to load it; rebuild with a matching profile")
    specs = dict(inputs) if isinstance(inputs, Mapping) else {name: None for name in inputs}
    types = info.get("inputs") or {}
    tensors = tuple(
        TensorSpec(name, types.get(name, TOKEN_DATA_TYPE), (-1,)) if dims is None
        else TensorSpec(name, types.get(name, "TYPE_FP32"), tuple(int(d) for d in dims))
        for name, dims in specs.items()
    )
    config = gpu_model_config(opts, tensors, outputs, "tensorrt_plan", "model.plan", {
        contract.PARAM_TENSORRT_VERSION: str(info["tensorrt_version"]),
        contract.PARAM_COMPUTE_CAPABILITY: str(info["compute_capability"]),
    })
    files: dict[str, Path | str] = {
        "1/model.plan": Path(plan_path),
        "parity.json": json.dumps(parity, indent=2),
        "tensorrt.json": json.dumps({**info, "entry": opts.name}, indent=2),
    }
    return ModelDir(config, files)


def serve_plan(models: list[ModelDir], opts: EntryOptions, plan_path: Path, inputs: Mapping[str, Shape | None] | Sequence[str],
               parity: dict, info: dict) -> None:
    """Make the entry's model step (in `models`, as the entry writer made it for the ONNX graph) the native
    tensorrt_plan model of `plan_path`, with the graph step's outputs."""
    i = next(i for i, m in enumerate(models) if m.config.name == opts.step("model"))
    models[i] = tensorrt_model(opts, plan_path, inputs, models[i].config.outputs, parity, info)

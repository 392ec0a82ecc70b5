"""Faster forms of an exported ONNX encoder, each validated on its own against PyTorch by the caller:

- `optimize`: ONNX Runtime's transformer graph fusions (attention, layer norm, GELU, skip-layer-norm);
- `quantize_int8`: dynamic INT8 quantisation of the MatMul weights, for CPUs (activations stay float);
- `quantize_static_int8`: static INT8 quantisation of convolutions (weights and activations, QDQ), calibrated on
  sample inputs: for convolutional models (YOLO), where the dynamic form finds nothing to quantise;
- `to_fp16`: float16 weights and compute for GPUs, inputs and outputs left in float32.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .exceptions import ExportError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "int8", "fp16")
# Default floor on the cosine similarity to PyTorch, per row of every output, for the lossy forms.
DEFAULT_MIN_COSINE = {"int8": 0.95, "fp16": 0.999}
# transformers model_type -> the optimizer's model type (its fusions are per family).
_OPTIMIZER_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "distilbert": "bert", "camembert": "bert",
                    "electra": "bert", "deberta-v2": "bert", "mpnet": "bert", "albert": "bert", "vit": "vit"}


def optimize(source: Path, out: Path, config: dict) -> Path:
    """Transformer fusions for the model family in `config` (a checkpoint's config.json)."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = _OPTIMIZER_TYPES.get(str(config.get("model_type")))
    if model_type is None:
        raise ExportError(f"--optimize knows no fusions for model_type {config.get('model_type')!r}; supported: "
                          f"{', '.join(sorted(_OPTIMIZER_TYPES))} (drop --optimize to export unfused)")
    heads = int(config.get("num_attention_heads") or 0)
    hidden = int(config.get("hidden_size") or 0)
    optimized = optimize_model(str(source), model_type=model_type, num_heads=heads, hidden_size=hidden, opt_level=1,
                               use_gpu=False)
    fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    log.info("  fused operators: %s", ", ".join(f"{k} {v}" for k, v in fused.items()) or "none")
    optimized.save_model_to_file(str(out))
    return out


def quantize_int8(source: Path, out: Path) -> Path:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(source), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm", "Attention"],
        # Per-channel scales: per-tensor ones lose too much on encoders (all-MiniLM-L6-v2: min cosine
        # to PyTorch 0.87 per tensor vs 0.97 per channel, on very short texts; >= 0.99 on sentences).
        per_channel=True,
        # 7-bit weights: x86 CPUs without VNNI (AVX2, plain AVX-512) multiply uint8 x int8 pairs with 16-bit
        # saturating adds (VPMADDUBSW), which overflow on full-range weights (ONNX Runtime's quantisation
        # guide). all-MiniLM-L6-v2, worst text "ok": min cosine 0.949 at 8 bits, 0.957 at 7.
        reduce_range=True,
        extra_options={
            # Only weight matmuls: quantising activation x activation (attention scores) costs accuracy.
            "MatMulConstBOnly": True,
            # Fused (com.microsoft) ops defeat ONNX shape inference; their outputs are float.
            "DefaultTensorType": onnx.TensorProto.FLOAT,
        },
    )
    return out


def quantize_static_int8(source: Path, out: Path, feeds, exclude: list[str] = ()) -> Path:
    """Convolutions to INT8 with activation ranges calibrated (min / max) on `feeds`, an iterable of input dicts,
    but for the nodes named in `exclude`. Everything else, a detector's box and score arithmetic included, stays
    float."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    root = logging.getLogger()  # the quantiser logs a line per bias it copies on the root logger, at info
    level, root.level = root.level, max(root.level, logging.WARNING)
    try:
        quantize_static(str(source), str(out), Feeds(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["Conv"],
                        per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        # 7-bit weights on CPUs without VNNI, as for quantize_int8
                        reduce_range=True, nodes_to_exclude=list(exclude))
    finally:
        root.setLevel(level)
    return out


def to_fp16(source: Path, out: Path) -> Path:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
    onnx.save(model, str(out))
    return out

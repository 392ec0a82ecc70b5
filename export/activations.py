"""What an image graph's activations take at its largest input, for `rtxserve plan` (deploy/plan.py).

A detector or a CNN classifier records no transformer dimensions to size its activations from. Its graph does: onnx-tool
infers every tensor's shape at a given input and lays the live tensors out as a memory planner would, reusing what is
dead (`Graph.compress_memory`). Measured at batch 1 and 2, the difference is what each more image adds and the rest is
fixed, so the planner can size any max batch. The figures are the graph's own dtypes (an fp16 graph's are half); a
statically quantised (QDQ) graph's dequantised weights count as fixed, though ONNX Runtime fuses them away.

An estimate, not a measurement: on this CPU, ONNX Runtime's peak memory grew per image (batch 4 to 8) by 2.4 MB for the
fixture YOLO at 128x128, where this gives 1.6 MB with the planner's arena factor; 0.26 against 0.36 MB for the RT-DETR,
0.45 against 1.0 MB for the DETR. Convolutions' working buffers are not tensors of the graph.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def peak_bytes(onnx_path: Path, feeds: dict[str, tuple[int, ...]]) -> int:
    """The peak bytes of the graph's live tensors (its inputs included, its weights not) when run on `feeds`' shapes."""
    import numpy as np
    import onnx
    import onnx_tool

    graph = onnx_tool.Model(onnx.load(str(onnx_path))).graph
    graph.shape_infer({name: np.zeros(shape, np.float32) for name, shape in feeds.items()})
    return int(graph.compress_memory()[1])


def graph_activations(onnx_path: Path, input_name: str, item_shape: tuple[int, ...]) -> dict | None:
    """{"per_item_bytes", "fixed_bytes", "item_shape"} of the graph at one input of `item_shape` (no batch axis), or
    None, with a warning, where onnx-tool cannot follow the graph (the planner then says its estimate is a guess)."""
    try:
        one, two = (peak_bytes(onnx_path, {input_name: (batch, *item_shape)}) for batch in (1, 2))
    except Exception as exc:  # onnx-tool follows most graphs; one it cannot only costs the planner its figure
        log.warning("could not size the graph's activations (onnx-tool: %s: %s); `rtxserve plan` will assume them",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    per_item = max(two - one, 0)
    return {"per_item_bytes": per_item, "fixed_bytes": max(one - per_item, 0), "item_shape": list(item_shape)}

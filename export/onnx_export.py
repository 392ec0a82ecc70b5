"""PyTorch -> ONNX with dynamic batch (and, for token inputs, sequence) axes (one rerunnable step)."""

from __future__ import annotations

import inspect
import logging
import warnings
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_OPSET = 17


def export(model, sample: dict, path: Path, output_names: list[str], opset: int = DEFAULT_OPSET,
           image_size_varies: bool = False) -> Path:
    """Export `model` called with the keyword tensors in `sample` to `path`.

    Args:
        model: a torch module in eval mode taking the tensors of `sample` as keyword arguments.
        sample: name -> tensor ([batch, seq] tokens, or [batch, ...] fixed-shape such as images); its names
            become the ONNX input names, in order.
        path: where to write the .onnx file.
        output_names: names for the model's outputs, in order.
        opset: ONNX opset.
        image_size_varies: images [batch, 3, H, W] vary in H and W too (a detector that keeps each image's aspect).

    Returns:
        `path`.
    """
    import torch

    # The exporter names graph inputs in the order of forward()'s parameters: keep `sample` in that order.
    order = list(inspect.signature(model.forward).parameters)
    sample = {name: sample[name] for name in sorted(sample, key=order.index)}
    input_names = list(sample)
    # Token tensors [batch, seq] vary in both; images [batch, 3, H, W] in batch (and in H, W where told so).
    image_axes = {0: "batch", 2: "height", 3: "width"} if image_size_varies else {0: "batch"}
    dynamic_axes = {name: {0: "batch", 1: "sequence"} if sample[name].dim() == 2 else
                    image_axes if sample[name].dim() == 4 else {0: "batch"} for name in input_names}
    dynamic_axes.update({name: {0: "batch"} for name in output_names})
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter warns about Python control flow on shapes in HF code; the
        # parity check that follows every export is what proves the graph is right.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (),
            str(path),
            kwargs=dict(sample),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            opset_version=opset,
            dynamo=False,  # torch.export cannot trace HF encoders' masking code (torch 2.13)
        )
    log.info("wrote %s (%.1f MB, opset %d)", path, path.stat().st_size / 1e6, opset)
    return path

"""An encoder entry's TensorRT plan (`--tensorrt`, a GPU machine): the options the export takes for it
(TensorRTOptions: the profile's batch and sequence ranges, the workspace, INT8's calibration inputs), and the plan
built from the entry's fp32 ONNX graph with the optimisation profile they and the entry set. Building any plan is
export/tensorrt/plan.py's; here is what an encoder's inputs and its entry ask of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..exceptions import ExportError
from ..triton.entry import EntryOptions
from .inputs import TextInputs


@dataclass(frozen=True)
class TensorRTOptions:
    """Build a TensorRT plan (GPU only) instead of serving the ONNX graph; `precision` of the export
    chooses fp32 / fp16 / int8 (INT8 calibrates on `calibration`: texts, or encoded images)."""

    batch: str | None = None  # MIN,OPT,MAX (default 1,B,B with B the max batch size)
    seq: str | None = None  # MIN,OPT,MAX tokens (default 1,L,L with L the max length)
    workspace_gb: float = 4.0
    calibration: list | None = None
    calibration_batch: int = 8


def build_entry_plan(steps, onnx_path: Path, work: Path, inputs, opts: EntryOptions, precision: str,
                     trt: TensorRTOptions) -> dict:
    """The plan of `onnx_path` (the fp32 graph) written to work/model.plan, for the entry `opts` serves: the profile
    from `trt` (a text entry's sequence up to the max length GPU entries pad to; an image's sides where they follow
    it), INT8 calibrated on `trt`'s inputs; returns what build_plan records."""
    from ..tensorrt.plan import Profile, build_plan

    text = isinstance(inputs, TextInputs)
    try:
        profile = Profile.parse(trt.batch, trt.seq, max_batch_size=opts.max_batch_size,
                                max_length=inputs.max_length if text else None)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    if not text:  # images whose size follows them (DETR's resize): each side's range too
        profile = replace(profile, side=inputs.plan_side())
    if text and profile.seq[2] != inputs.max_length:
        # On GPUs the tokenizer pads every text to the max length: the plan must take that length.
        raise ExportError(f"--trt-seq max {profile.seq[2]} must equal the entry's max length {inputs.max_length} "
                          f"(GPU entries pad to it); pass --max-length {profile.seq[2]} to serve shorter texts")
    feeds = inputs.calibration(trt.calibration, trt.calibration_batch) if precision == "int8" else None
    steps("building the TensorRT %s plan (profile %s; this takes minutes)", precision, profile.to_dict())
    return build_plan(onnx_path, work / "model.plan", inputs=inputs.plan_inputs(), profile=profile, precision=precision,
                      calibration_feeds=feeds, workspace_gb=trt.workspace_gb)

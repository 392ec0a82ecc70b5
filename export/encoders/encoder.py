"""Export a fine-tuned encoder: checkpoint -> validated ONNX -> Triton ensemble entry.

One pipeline for every encoder task; what differs per task (which outputs the graph has, how the
model is wrapped, which Triton models follow it) is a `TaskSpec`, built by the task's entry in ENCODER_TASKS
(export/encoders/task_specs.py).
"""

from __future__ import annotations

import contextlib
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.reference import FILE as REFERENCE_FILE, ReferenceError
from core.tasks import OBJECT_DETECTION, TEXT_CLASSIFICATION

from .. import onnx_export
from ..checkpoint import find_weights
from ..exceptions import ExportError
from ..parity import ParityReport
from ..progress import Steps
from ..trainers import zero
from ..triton import repository
from ..triton.entry import EntryOptions
from .inputs import SAMPLE_TEXTS, ImageInputs, TextInputs
from .task_specs import ENCODER_TASKS, Checkpoint, inspect_checkpoint
from .tensorrt_plan import TensorRTOptions, build_entry_plan

if TYPE_CHECKING:
    from .adapters import EncoderAdapter

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    entry: list[Path]
    parity: dict
    seconds: float


def _load_models(ckpt: Checkpoint, spec, adapter) -> tuple:
    """(the model to export, the reference its export is checked against), both wrapped for the task.
    A plain checkpoint is its own reference; an adapter exports merged and is checked against the unmerged
    PeftModel."""
    import transformers

    auto_class = getattr(transformers, ENCODER_TASKS[ckpt.task].auto_class)
    if adapter is not None:
        from .adapters import load_models

        merged, reference = load_models(adapter, auto_class)
        return spec.wrap(merged, ckpt).eval(), spec.wrap(reference, ckpt).eval()
    try:
        # Eager attention: it exports as the MatMul-Softmax pattern ONNX Runtime fuses into its Attention op.
        model = spec.wrap(auto_class.from_pretrained(ckpt.path, dtype="float32", attn_implementation="eager").eval(), ckpt).eval()
    except Exception as exc:
        raise ExportError(f"cannot load the weights in {ckpt.weights} ({type(exc).__name__}: {exc}); the file may be truncated or corrupt") from exc
    return model, model


def _adapter_effect(reference, feeds: dict) -> float:
    """How far the adapter moves the first output (max abs), so the report shows the check compares different models."""
    import torch

    peft_model = reference.model if hasattr(reference, "model") and hasattr(reference.model, "disable_adapter") else reference
    inputs = {n: torch.from_numpy(v) for n, v in feeds.items()}
    with torch.no_grad():
        with_adapter = reference(**inputs)
        with peft_model.disable_adapter():
            without = reference(**inputs)
    first = lambda out: (out[0] if isinstance(out, tuple) else out.logits).numpy()  # noqa: E731
    return float(np.abs(first(with_adapter) - first(without)).max())


def _validate(model, session, cases: list[dict[str, np.ndarray]], atol: float, output_names: list[str]) -> ParityReport:
    """Run every case through PyTorch and ONNX Runtime and fold the outputs into one report."""
    import torch

    report = ParityReport(atol=atol)
    for feeds in cases:
        with torch.no_grad():
            ref = model(**{n: torch.from_numpy(v) for n, v in feeds.items()})
        ref = ref if isinstance(ref, tuple) else (ref.logits,)
        got = session.run(output_names, feeds)
        report.add(dict(zip(output_names, (r.numpy() for r in ref))), dict(zip(output_names, got)))
    return report


@dataclass(frozen=True)
class EncoderOptions:
    """How to export an encoder checkpoint: everything but the checkpoint, its task, the entry and the repository.

    max_length: tokenizer truncation length (default: the checkpoint's, else the model's limit).
    atol: tolerated max abs difference of every output between ONNX Runtime and PyTorch.
    allow_drift: keep an export that breaches `atol` (the report records the breach).
    force: replace an existing entry of the same name.
    sample_texts: texts for the parity check (default: a built-in varied set).
    sample_images: encoded PNG / JPEG images for the parity check of an image model (default: synthetic images
        of varied sizes and modes).
    command: the command line that reproduces this export, recorded in the metadata.
    optimize: apply ONNX Runtime's transformer fusions (validated like the plain graph, against `atol`).
    precision: fp32, int8 (dynamic quantisation, CPU) or fp16 (GPU); int8 / fp16 are validated against
        `min_cosine` (every row of every output; default 0.95 for int8, 0.999 for fp16) instead of `atol`.
    aggregation: token-classification only: how sub-word predictions become entities when a request names none
        (none, simple, first, average, max: as transformers' pipeline).
    base: an adapter's base model folder (default: the local folder the adapter records); for a DeepSpeed ZeRO
        checkpoint without them, the folder with its config and tokenizer.
    tensorrt: build a TensorRT plan from the fp32 graph for `precision` and serve it (target gpu, a machine with a
        GPU and TensorRT 10); the plan is validated like the ONNX variants.
    calibration_images: encoded images the static INT8 quantisation of an Ultralytics YOLO calibrates on (default:
        the sample images); other models quantise dynamically and take none.
    nms: an Ultralytics YOLO only: NMS in the graph (Ultralytics' nms=True), its iou and max_det fixed at export;
        otherwise the entry's postprocess step runs NMS, with each request's iou.
    eval_set: a JSON-lines file of inputs (and gold answers) for the reference set written beside the entry (what
        `rtxserve eval` compares the served answers with); default: the parity check's samples.
    """

    max_length: int | None = None
    atol: float = 1e-4
    allow_drift: bool = False
    force: bool = False
    sample_texts: list[str] | None = None
    sample_images: list[bytes] | None = None
    command: str = ""
    optimize: bool = False
    precision: str = "fp32"
    min_cosine: float | None = None
    aggregation: str = "first"
    base: str | Path | None = None
    tensorrt: TensorRTOptions | None = None
    calibration_images: list[bytes] | None = None
    nms: bool = False
    eval_set: Path | None = None


@dataclass
class _Source:
    """The checkpoint to export, once resolved: plain, a LoRA adapter on its base, or a ZeRO checkpoint converted."""

    ckpt: Checkpoint
    adapter: EncoderAdapter | None = None
    conversion: dict | None = None


def export_encoder(checkpoint: str | Path, task: str, entry: EntryOptions, repo: Path,
                   options: EncoderOptions = EncoderOptions()) -> ExportResult:
    """Export an encoder checkpoint for `task` to ONNX, validate it against PyTorch, write its Triton entry.

    `checkpoint` is a folder written by `save_pretrained` (model + tokenizer); a PEFT LoRA adapter folder
    (adapter_config.json), merged into its base before export and validated against the unmerged PeftModel; or a
    DeepSpeed ZeRO checkpoint (a Trainer `checkpoint-N` with `global_stepN/` shards and no weights), consolidated
    with DeepSpeed and checked against DeepSpeed's engine first. `task` is one of ENCODER_TASKS (task_specs.py), `entry`
    the entry's name, target, instances and batching, `repo` the Triton model repository to write into.

    Returns the written model folders, the parity report and the wall time. Raises ExportError on bad input, a
    failed load, or a parity breach (nothing is written then).
    """
    from ..detection.yolo import ultralytics_checkpoint

    weights = ultralytics_checkpoint(Path(checkpoint).expanduser())
    if weights is not None:  # exported by Ultralytics itself, in its own environment
        from ..detection.yolo import check_task, export_yolo

        check_task(weights, task)
        return ExportResult(*export_yolo(weights, entry, repo, options))
    _check_options(options, entry)
    with contextlib.ExitStack() as scratch:
        source = _resolve(Path(checkpoint).expanduser(), task, entry, repo, options, scratch)
        steps = Steps(6 + options.optimize + (options.precision != "fp32") + (options.tensorrt is not None)
                      + (task == OBJECT_DETECTION), log)  # detection: the served answers against the pipeline's
        if options.command:
            log.info("reproduce with: %s", options.command)
        model, reference, inputs, spec = _load(source, options, steps)
        work = scratch.enter_context(repository.work_dir(repo))
        served, reports, plan_info = _export_variants(model, reference, inputs, spec, source, options, entry, work, steps)
        steps("writing Triton entry %s (%s, %d instance(s), max batch %d)", entry.name, entry.target, entry.instances,
              entry.max_batch_size)
        parity, metadata = _record(source, options, entry, reports, plan_info, reference, inputs, spec)
        steps("writing the reference set: the framework's own answers on %s", options.eval_set or f"{len(inputs.samples)} "
              f"sample {inputs.what}")
        reference_text, metadata["reference"] = _reference(source, reference, inputs, parity, options)
        # what `rtxserve plan` sizes an image graph's activations from (a plan's: the fp32 graph it was built from)
        metadata |= inputs.activations(served if plan_info is None else work / "model.onnx")
        if spec.served_check is not None:  # what the served steps answer against the framework's own predict
            steps("checking the served answers against the framework's own predict")
            from ..detection.served import gate_served

            parity["served"] = gate_served(spec.served_check(served, source.ckpt.path, inputs), options.precision,
                                           options.allow_drift)
        models = spec.entry(entry, onnx_path=served, metadata=metadata, parity=parity, **inputs.entry_kwargs())
        next(m for m in models if "rtxserve.json" in m.files).files[REFERENCE_FILE] = reference_text
        if plan_info is not None:  # the model step becomes the native tensorrt_plan model
            from ..tensorrt.plan import serve_plan

            serve_plan(models, entry, served, inputs.plan_inputs(), parity, plan_info)
        written = repository.commit(repo, models, work, options.force)
    steps("done: %s", ", ".join(p.name for p in written))
    return ExportResult(entry=written, parity=parity, seconds=steps.seconds)


def _reference(source: _Source, reference, inputs, parity: dict, options: EncoderOptions) -> tuple[str, dict]:
    """The reference set's file and what rtxserve.json names it by (export/reference.py)."""
    from .reference import encoder_reference

    try:
        return encoder_reference(source.ckpt.task, source.ckpt, reference, inputs, parity, aggregation=options.aggregation,
                                 eval_set=options.eval_set,
                                 multi_label=source.ckpt.config.get("problem_type") == "multi_label_classification").dump()
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


def _check_options(options: EncoderOptions, entry: EntryOptions) -> None:
    """Refuse what cannot be built before any work."""
    from .. import variants

    if options.precision not in variants.PRECISIONS:
        raise ExportError(f"unknown precision {options.precision!r}; valid: {', '.join(variants.PRECISIONS)}")
    if options.calibration_images is not None:
        raise ExportError("--calibration-images without --tensorrt calibrates an Ultralytics YOLO's static INT8; this "
                          "model's int8 is dynamic and takes none")
    if options.nms:
        raise ExportError("--nms puts an Ultralytics YOLO's NMS in its graph; this model is not one (a DETR-family "
                          "detector has no NMS)")
    if options.tensorrt is None:
        return
    if entry.target != "gpu":
        raise ExportError("--tensorrt builds a plan that runs on GPUs only: add --target gpu")
    if options.optimize:
        raise ExportError("--optimize makes an ONNX Runtime graph, and TensorRT fuses the plain graph itself: "
                          "drop --optimize with --tensorrt")
    if options.precision == "int8" and not options.tensorrt.calibration:
        raise ExportError("an INT8 TensorRT plan calibrates on sample inputs: pass --calibration-texts FILE "
                          "(--calibration-images DIR for image models)")


def _resolve(path: Path, task: str, entry: EntryOptions, repo: Path, options: EncoderOptions,
             scratch: contextlib.ExitStack) -> _Source:
    """Which checkpoint is exported: a LoRA adapter on its base, a ZeRO checkpoint converted (into a scratch
    folder that lives as long as `scratch`), or the folder itself."""
    from .adapters import is_adapter, resolve_adapter

    if is_adapter(path):
        adapter = resolve_adapter(path, task, options.base)
        repository.check_free(repo, entry.model_names(), options.force)
        return _Source(adapter.checkpoint, adapter=adapter)
    if path.is_dir() and find_weights(path) is None and zero.is_zero(path):
        repository.check_free(repo, entry.model_names(), options.force)  # before the conversion's minutes
        converted, conversion = _convert_zero(path, task, options, scratch.enter_context(repository.work_dir(repo)))
        return _Source(inspect_checkpoint(converted, task), conversion=conversion)
    source = _Source(inspect_checkpoint(path, task))
    repository.check_free(repo, entry.model_names(), options.force)
    return source


def _convert_zero(path: Path, task: str, options: EncoderOptions, work: Path) -> tuple[Path, dict]:
    """A ZeRO checkpoint consolidated with DeepSpeed into a Hugging Face folder under `work`, checked against
    DeepSpeed's engine; returns the folder and the conversion's figures."""
    import transformers

    if ENCODER_TASKS[task].image:
        raise ExportError(f"{path} is a DeepSpeed ZeRO checkpoint of an image model; consolidate it with the "
                          "zero_to_fp32.py beside it, then export the folder that writes")
    base = Path(options.base) if options.base else None
    ckpt = zero.inspect_zero(path)
    config_dir = zero.config_folder(ckpt, base)
    tokenizer = transformers.AutoTokenizer.from_pretrained(zero.tokenizer_folder(config_dir, base))
    ids = [tokenizer(t, truncation=True)["input_ids"] for t in options.sample_texts or SAMPLE_TEXTS]
    auto_class = ENCODER_TASKS[task].auto_class
    hf, conversion = zero.to_hugging_face(ckpt, config_dir, work, auto_class=auto_class, ids=ids, dtype="float32",
                                          atol=options.atol, allow_drift=options.allow_drift,
                                          output="last_hidden_state" if auto_class == "AutoModel" else "logits")
    tokenizer.save_pretrained(hf)
    return hf, conversion | {"source": str(path.resolve()), "converted_from": zero.origin(ckpt)}


def _load(source: _Source, options: EncoderOptions, steps: Steps) -> tuple:
    """(the model to export, the reference it is checked against, its sample inputs, the task's spec)."""
    ckpt, adapter = source.ckpt, source.adapter
    spec = ENCODER_TASKS[ckpt.task].build_spec(ckpt, options.aggregation)
    if adapter is None:
        steps("loading %s (%s)", ckpt.path, ckpt.architecture)
    else:
        steps("loading LoRA adapter %s on base %s (%s) and merging it", adapter.adapter.path, adapter.base_path,
              ckpt.architecture)
    model, reference = _load_models(ckpt, spec, adapter)
    if ENCODER_TASKS[ckpt.task].image:
        inputs = ImageInputs(ckpt, options.sample_images, plan=options.tensorrt is not None)
    else:
        inputs = TextInputs(ckpt, model, options.max_length if options.max_length is not None else spec.max_length,
                            options.sample_texts)
    return model, reference, inputs, spec


def _export_variants(model, reference, inputs, spec, source: _Source, options: EncoderOptions, entry: EntryOptions,
                     work: Path, steps: Steps) -> tuple[Path, dict, dict | None]:
    """ONNX, then each variant asked for (fused, TensorRT plan or lower precision), each validated against
    PyTorch: (the served file, the reports by variant, the plan's figures or None)."""
    import torch

    from .. import variants

    served = work / "model.onnx"
    steps("exporting ONNX (%s; outputs %s)", inputs.describe(), ", ".join(spec.outputs))
    sample = inputs.sample()
    onnx_export.export(model, {n: torch.from_numpy(v) for n, v in sample.items()}, served, list(spec.outputs),
                       image_size_varies=getattr(inputs, "varies", False))
    check = _Check(reference, inputs.cases(), inputs, list(spec.outputs), options, source.adapter is not None, steps)
    reports = {"fp32": check(served, "ONNX Runtime (fp32)", lossy=False)}
    if options.optimize:
        served = variants.optimize(served, work / "model.optimized.onnx", source.ckpt.config)
        reports["optimized"] = check(served, "the fused graph", lossy=False)
    plan_info = None
    if options.tensorrt is not None:
        plan_info = build_entry_plan(steps, served, work, inputs, entry, options.precision, options.tensorrt)
        served = work / "model.plan"
        reports[f"tensorrt-{options.precision}"] = check(served, f"the TensorRT {options.precision} plan",
                                                     lossy=options.precision != "fp32")
    elif options.precision != "fp32":
        convert = variants.quantize_int8 if options.precision == "int8" else variants.to_fp16
        served = convert(served, work / f"model.{options.precision}.onnx")
        reports[options.precision] = check(served, f"the {options.precision} graph", lossy=True)
    return served, reports, plan_info


@dataclass
class _Check:
    """One variant's validation against the reference on every case (atol, or min cosine for a lossy one)."""

    reference: object
    cases: list
    inputs: object
    outputs: list[str]
    options: EncoderOptions
    adapter: bool
    steps: Steps

    def __call__(self, path: Path, what: str, *, lossy: bool) -> dict:
        from .. import variants
        from ..tensorrt.runtime import session

        self.steps("validating %s against PyTorch on %d %s", what, len(self.inputs.samples), self.inputs.what)
        report = _validate(self.reference, session(path), self.cases, self.options.atol, self.outputs)
        report.notes += self.inputs.notes
        if self.adapter:
            report.notes.append("reference: the unmerged PeftModel (base + adapter); the export is the merged model")
        report.min_cosine = (self.options.min_cosine or variants.DEFAULT_MIN_COSINE[self.options.precision]) if lossy else None
        for out in report.outputs.values():
            log.info("  %s: max abs diff %.3g, max rel diff %.3g, min cosine %.6f, top-1 agreement %.0f%%",
                     out.name, out.max_abs_diff, out.max_rel_diff, out.min_cosine, 100 * out.top1_agreement)
        report.check(self.options.allow_drift)
        return report.to_dict()


def _record(source: _Source, options: EncoderOptions, entry: EntryOptions, reports: dict, plan_info: dict | None,
            reference, inputs, spec) -> tuple[dict, dict]:
    """The entry's parity (the served variant's figures on top, every variant's below: drift is visible step by
    step) and its metadata (what was exported, from what, options)."""
    adapter, conversion = source.adapter, source.conversion
    parity = {**list(reports.values())[-1], "variant": list(reports)[-1], "variants": reports}
    if adapter is not None:
        parity["adapter_effect_max_abs"] = _adapter_effect(reference, inputs.sample())
    metadata = _metadata(source.ckpt, entry, options.command, parity) | inputs.metadata() | spec.metadata
    metadata |= {"optimized": options.optimize, "precision": options.precision}
    if adapter is not None:
        metadata |= {"source": str(adapter.adapter.path.resolve()), "adapter": {
            "path": str(adapter.adapter.path.resolve()), "base": str(adapter.base_path.resolve()),
            "rank": adapter.adapter.rank, "alpha": adapter.adapter.alpha, "merged": True}}
    if conversion is not None:
        parity["conversion"] = conversion
        metadata |= {"source": conversion["source"], "converted_from": conversion["converted_from"]}
    if plan_info is not None:
        metadata["tensorrt"] = plan_info
    return parity, metadata


def export_text_classification(checkpoint: str | Path, opts: EntryOptions, repo: Path,
                               options: EncoderOptions = EncoderOptions()) -> ExportResult:
    """`export_encoder` for task text-classification."""
    return export_encoder(checkpoint, TEXT_CLASSIFICATION, opts, repo, options)


DIMENSIONS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings",
              "image_size", "patch_size", "num_channels")


def _metadata(ckpt: Checkpoint, opts: EntryOptions, command, parity) -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "task": ckpt.task,
        "source": str(ckpt.path.resolve()),
        "architecture": ckpt.architecture,
        # what `rtxserve plan` needs to size activations without the checkpoint
        "model_dimensions": {k: ckpt.config[k] for k in DIMENSIONS if isinstance(ckpt.config.get(k), int)},
        "target": opts.target,
        "instances": opts.instances,
        "max_batch_size": opts.max_batch_size,
        "command": command,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
        "parity_passed": parity["passed"],
    }

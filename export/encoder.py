"""Export a fine-tuned encoder: checkpoint -> validated ONNX -> Triton ensemble entry.

One pipeline for every encoder task; what differs per task (which outputs the graph has, how the
model is wrapped, which Triton models follow it) is a `TaskSpec` from export/tasks.py.
"""

from __future__ import annotations

import inspect
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import onnx_export, repository
from .checkpoint import TASKS, Checkpoint, inspect_checkpoint
from .exceptions import ExportError
from .parity import ParityReport
from .progress import Steps
from .triton_entry import EntryOptions

log = logging.getLogger(__name__)

# Varied lengths, punctuation, non-ASCII, and one text longer than any small model's maximum
# length so that truncation is part of what parity covers.
SAMPLE_TEXTS = [
    "I love this product, it works perfectly.",
    "Terrible. It broke after one day!",
    "The package arrived on Tuesday.",
    "Das Essen war großartig — très bien, 👍",
    "ok",
    " ".join(["a very long review that goes on and on"] * 80),
]


@dataclass
class ExportResult:
    entry: list[Path]
    parity: dict
    seconds: float


def _load(ckpt: Checkpoint, spec):
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt.path, use_fast=True)
    except Exception as exc:
        raise ExportError(f"cannot load the tokenizer in {ckpt.path}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ExportError(f"the tokenizer in {ckpt.path} has no fast (Rust) version; Triton serving needs tokenizer.json")
    auto_class = getattr(transformers, TASKS[ckpt.task][1])
    try:
        # Eager attention: it exports as the MatMul-Softmax pattern ONNX Runtime fuses into its Attention op.
        model = spec.wrap(auto_class.from_pretrained(ckpt.path, dtype="float32", attn_implementation="eager").eval(), ckpt).eval()
    except Exception as exc:
        raise ExportError(f"cannot load the weights in {ckpt.weights} ({type(exc).__name__}: {exc}); the file may be truncated or corrupt") from exc
    return tokenizer, model


def _input_names(tokenizer, model) -> list[str]:
    accepted = inspect.signature(model.forward).parameters
    if hasattr(model, "model"):  # a task wrapper: the inputs the transformer inside takes
        accepted = set(accepted) & set(inspect.signature(model.model.forward).parameters)
    names = [n for n in tokenizer.model_input_names if n in accepted]
    if "input_ids" not in names:
        raise ExportError(f"tokenizer inputs {tokenizer.model_input_names} do not include input_ids")
    return ["input_ids"] + [n for n in names if n != "input_ids"]


def _max_length(tokenizer, config: dict, requested: int | None) -> int:
    limit = int(config.get("max_position_embeddings") or 512)
    # RoBERTa-style position ids start after the padding index: two positions are not usable.
    if config.get("model_type") in {"roberta", "xlm-roberta", "camembert"}:
        limit -= 2
    model_max = getattr(tokenizer, "model_max_length", limit) or limit
    default = min(limit, int(model_max) if model_max < 1e9 else limit)
    if requested is None:
        return default
    if not 1 <= requested <= limit:
        raise ExportError(f"--max-length {requested} is outside 1..{limit} (the model's position limit)")
    return requested


def _tokenizer_for_serving(tokenizer, max_length: int, pad_id: int):
    """The Rust tokenizer exactly as the Triton tokenizer model will configure it."""
    from tokenizers import Tokenizer

    serving = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    serving.enable_truncation(max_length=max_length)
    serving.enable_padding(pad_id=pad_id)
    return serving


def _validate(model, session, tokenizer, serving_tok, input_names, texts, max_length, atol, output_names) -> ParityReport:
    import torch

    report = ParityReport(atol=atol)
    cases = [[t] for t in texts] + [texts]
    for case in cases:
        enc = tokenizer(case, padding=True, truncation=True, max_length=max_length, return_tensors="np")
        served = serving_tok.encode_batch(case)
        if any(list(e.ids) != list(row) for e, row in zip(served, enc["input_ids"])):
            raise ExportError("the serving tokenizer (tokenizer.json) encodes differently from the checkpoint's tokenizer")
        feeds = {n: enc[n].astype(np.int64) for n in input_names}
        with torch.no_grad():
            ref = model(**{n: torch.from_numpy(v) for n, v in feeds.items()})
        ref = ref if isinstance(ref, tuple) else (ref.logits,)
        got = session.run(output_names, feeds)
        report.add(dict(zip(output_names, (r.numpy() for r in ref))), dict(zip(output_names, got)))
    report.notes.append("serving tokenizer matched the checkpoint tokenizer on every sample")
    return report


def export_encoder(
    checkpoint: str | Path,
    task: str,
    opts: EntryOptions,
    repo: Path,
    *,
    max_length: int | None = None,
    atol: float = 1e-4,
    allow_drift: bool = False,
    force: bool = False,
    sample_texts: list[str] | None = None,
    command: str = "",
    optimize: bool = False,
    precision: str = "fp32",
    min_cosine: float | None = None,
    aggregation: str = "first",
) -> ExportResult:
    """Export an encoder checkpoint for `task` to ONNX, validate it against PyTorch, write its Triton entry.

    Args:
        checkpoint: folder written by `save_pretrained` (model + tokenizer).
        task: one of export.checkpoint.TASKS.
        opts: entry name, target, instances and batching.
        repo: the Triton model repository to write into.
        max_length: tokenizer truncation length (default: the checkpoint's, else the model's limit).
        atol: tolerated max abs difference of every output between ONNX Runtime and PyTorch.
        allow_drift: keep an export that breaches `atol` (the report records the breach).
        force: replace an existing entry of the same name.
        sample_texts: texts for the parity check (default: a built-in varied set).
        command: the command line that reproduces this export, recorded in the metadata.
        optimize: apply ONNX Runtime's transformer fusions (validated like the plain graph, against `atol`).
        precision: fp32, int8 (dynamic quantisation, CPU) or fp16 (GPU); int8 / fp16 are validated
            against `min_cosine` (every row of every output; default 0.95 for int8, 0.999 for fp16) instead of `atol`.
        aggregation: token-classification only: how sub-word predictions become entities when a request
            names none (none, simple, first, average, max: as transformers' pipeline).

    Returns:
        the written model folders, the parity report and the wall time.

    Raises:
        ExportError: bad input, a failed load, or a parity breach (nothing is written then).
    """
    import onnxruntime as ort

    from .tasks import spec_for

    from . import variants

    if precision not in variants.PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}; valid: {', '.join(variants.PRECISIONS)}")
    steps = Steps(5 + optimize + (precision != "fp32"), log)
    ckpt = inspect_checkpoint(checkpoint, task)
    spec = spec_for(ckpt, aggregation=aggregation)
    repository.check_free(repo, opts.model_names(), force)
    if command:
        log.info("reproduce with: %s", command)
    steps("loading %s (%s)", ckpt.path, ckpt.architecture)
    tokenizer, model = _load(ckpt, spec)
    input_names = _input_names(tokenizer, model)
    length = _max_length(tokenizer, ckpt.config, max_length if max_length is not None else spec.max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    serving_tok = _tokenizer_for_serving(tokenizer, length, pad_id)

    with repository.work_dir(repo) as work:
        onnx_path = work / "model.onnx"
        steps("exporting ONNX (inputs %s, outputs %s, max length %d)", ", ".join(input_names), ", ".join(spec.outputs), length)
        sample = tokenizer(SAMPLE_TEXTS[:2], padding=True, return_tensors="pt")
        onnx_export.export(model, {n: sample[n] for n in input_names}, onnx_path, list(spec.outputs))

        texts = sample_texts or SAMPLE_TEXTS

        def validate(path: Path, what: str, lossy: bool) -> dict:
            steps("validating %s against PyTorch on %d texts", what, len(texts))
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            report = _validate(model, session, tokenizer, serving_tok, input_names, texts, length, atol, list(spec.outputs))
            report.min_cosine = (min_cosine or variants.DEFAULT_MIN_COSINE[precision]) if lossy else None
            for out in report.outputs.values():
                log.info("  %s: max abs diff %.3g, max rel diff %.3g, min cosine %.6f, top-1 agreement %.0f%%",
                         out.name, out.max_abs_diff, out.max_rel_diff, out.min_cosine, 100 * out.top1_agreement)
            report.check(allow_drift)
            return report.to_dict()

        reports = {"fp32": validate(onnx_path, "ONNX Runtime (fp32)", False)}
        if optimize:
            onnx_path = variants.optimize(onnx_path, work / "model.optimized.onnx", ckpt.config)
            reports["optimized"] = validate(onnx_path, "the fused graph", False)
        if precision != "fp32":
            convert = variants.quantize_int8 if precision == "int8" else variants.to_fp16
            onnx_path = convert(onnx_path, work / f"model.{precision}.onnx")
            reports[precision] = validate(onnx_path, f"the {precision} graph", True)

        steps("writing Triton entry %s (%s, %d instance(s), max batch %d)", opts.name, opts.target, opts.instances, opts.max_batch_size)
        # The served graph's figures on top, every variant's below: drift is visible step by step.
        parity = {**list(reports.values())[-1], "variant": list(reports)[-1], "variants": reports}
        metadata = _metadata(ckpt, opts, input_names, length, command, parity) | spec.metadata
        metadata |= {"optimized": optimize, "precision": precision}
        models = spec.entry(
            opts,
            onnx_path=onnx_path,
            tokenizer_json=serving_tok.to_str(),
            input_names=input_names,
            max_length=length,
            pad_token_id=pad_id,
            metadata=metadata,
            parity=parity,
        )
        written = repository.commit(repo, models, work, force)
    steps("done: %s", ", ".join(p.name for p in written))
    return ExportResult(entry=written, parity=parity, seconds=steps.seconds)


def export_text_classification(checkpoint: str | Path, opts: EntryOptions, repo: Path, **kwargs) -> ExportResult:
    """`export_encoder` for task text-classification."""
    return export_encoder(checkpoint, "text-classification", opts, repo, **kwargs)


def _metadata(ckpt: Checkpoint, opts: EntryOptions, input_names, max_length, command, parity) -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {
        "task": ckpt.task,
        "source": str(ckpt.path.resolve()),
        "architecture": ckpt.architecture,
        "inputs": input_names,
        "max_length": max_length,
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

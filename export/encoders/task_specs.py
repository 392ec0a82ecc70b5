"""The encoder tasks: each a task of the registry (core/tasks.py), read as it is declared there, with what it adds to
the common export pipeline (export/encoders/encoder.py): how the PyTorch model is wrapped before export, the graph's
outputs, the Triton models after it, and task metadata; and the checkpoint each needs, inspected before any heavy work.

feature-extraction reads the sentence-transformers layout (`modules.json`, `1_Pooling/config.json`,
`sentence_bert_config.json`) so that pooling and normalisation match what the checkpoint was trained
and evaluated with; both run inside the ONNX graph, so Triton serves finished vectors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core import tasks as registry
from core.contract import DETECTION_DEFAULTS
from core.tasks import (FEATURE_EXTRACTION, IMAGE_CLASSIFICATION, OBJECT_DETECTION, TEXT_CLASSIFICATION,
                        TOKEN_CLASSIFICATION, Task)

from ..checkpoint import IMAGE_PROCESSOR_FILE, TOKENIZER_FILES, WEIGHT_FILES, find_weights, read_json
from ..detection.detr import DETR_FAMILY, NOT_YET, detections_parity, detector, query_count, top_k
from ..exceptions import ExportError
from ..triton.entry import (DetrOutputs, EntityRules, classification_entry, detection_entry, embedding_entry,
                            image_classification_entry, token_classification_entry)
from ..triton.python_models.ner_postprocess.entities import STRATEGIES, WORD_STRATEGIES

log = logging.getLogger(__name__)

# The legacy boolean keys of 1_Pooling/config.json -> the mode names sentence-transformers uses now
# (its newer configs hold `"pooling_mode": NAME` instead). weightedmean is not supported.
POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
SUPPORTED_POOLING = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")
# sentence-transformers modules after the Transformer that change the vector and are not handled here.
_UNSUPPORTED_MODULES = ("Dense", "LayerNorm", "WordWeights", "CNN", "LSTM", "WeightedLayerPooling")


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face checkpoint inspected for an encoder task: its folder, config, architecture and weights file."""

    path: Path
    task: str
    config: dict
    architecture: str
    weights: Path

    @property
    def labels(self) -> list[str]:
        """Label names in class-index order (`id2label`), or LABEL_i when the checkpoint has none."""
        id2label = self.config.get("id2label") or {}
        return label_names(id2label, len(id2label) or int(self.config.get("num_labels", 2)))


def label_names(id2label: dict, count: int) -> list[str]:
    """`count` label names from an `id2label` map (string or int keys), LABEL_i where it has none."""
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]


@dataclass(frozen=True)
class TaskSpec:
    outputs: tuple[str, ...]
    wrap: Callable  # (transformers model, Checkpoint) -> torch module whose outputs are `outputs`
    entry: Callable  # an export/triton/entry.py builder, task-specific arguments already bound
    max_length: int | None = None  # the checkpoint's own truncation length, if it records one
    metadata: dict = field(default_factory=dict)
    # (served model file, checkpoint folder, inputs) -> {"passed", "detail", ...}: the served steps' answers held
    # to the framework's own predict (recorded in parity.json as "served")
    served_check: Callable | None = None


@dataclass(frozen=True)
class EncoderTask(Task):
    """An encoder task of the registry (core/tasks.py), its facts read as declared there (arch_suffix, auto_class,
    inputs, peft_task_type), with what export adds to the common pipeline for it."""

    # (checkpoint, aggregation) -> the TaskSpec of that checkpoint: its outputs, wrapping, Triton models, metadata
    build_spec: Callable[[Checkpoint, str], TaskSpec] = field(kw_only=True)

    def __post_init__(self):
        if self.kind != registry.ENCODER:
            raise ValueError(f"{self.name} is a {self.kind} task, not an encoder's")

    @property
    def image(self) -> bool:
        """Whether its requests carry images (its checkpoint has an image processor, not a tokenizer)."""
        return self.inputs == "image"


@dataclass(frozen=True)
class Pooling:
    mode: str
    normalize: bool
    max_seq_length: int | None


def read_pooling(path: Path) -> Pooling:
    """Pooling and normalisation from a sentence-transformers folder; mean pooling without normalisation
    (and a note) for a bare transformers encoder."""
    modules_path = path / "modules.json"
    st_config = path / "sentence_bert_config.json"
    max_seq = read_json(st_config, "checkpoint").get("max_seq_length") if st_config.is_file() else None
    if not modules_path.is_file():
        log.info("note: %s has no modules.json (not a sentence-transformers folder): using mean pooling, no normalisation", path)
        return Pooling("mean", False, max_seq)
    try:
        modules = json.loads(modules_path.read_text())
    except json.JSONDecodeError as exc:
        raise ExportError(f"{modules_path} is not valid JSON ({exc})") from exc
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unsupported = [k for k in kinds if k in _UNSUPPORTED_MODULES]
    if unsupported:
        raise ExportError(f"{modules_path} has module(s) {', '.join(unsupported)} after pooling; supported pipelines are "
                          "Transformer -> Pooling [-> Normalize]")
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        raise ExportError(f"{modules_path} lists no Pooling module; cannot tell how token vectors become one vector")
    config_path = path / pooling.get("path", "") / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read the pooling config {config_path}: {exc}") from exc
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [name for key, name in POOLING_MODES.items() if config.get(key)] or ["mean"]
    if len(modes) != 1 or modes[0] not in SUPPORTED_POOLING:
        raise ExportError(f"{config_path}: pooling {' + '.join(map(str, modes))} is not supported; one of "
                          f"{', '.join(SUPPORTED_POOLING)} is")
    if config.get("include_prompt") is False:
        raise ExportError(f"{config_path}: include_prompt=false (instruction-excluding pooling) is not supported")
    return Pooling(modes[0], "Normalize" in kinds, max_seq)


def pooled_encoder(model, pooling: Pooling):
    import torch

    class PooledEncoder(torch.nn.Module):
        """Transformer -> pooling -> (normalisation); also each text's token count, for usage figures."""

        def __init__(self, encoder):
            super().__init__()
            self.model = encoder

        # Explicit arguments, not **kwargs: the ONNX exporter names graph inputs from the signature.
        def forward(self, input_ids, attention_mask, token_type_ids=None):
            extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            lengths = mask.sum(1)
            if pooling.mode == "cls":
                vector = hidden[:, 0]
            elif pooling.mode == "mean":
                vector = (hidden * mask).sum(1) / lengths.clamp(min=1e-9)
            elif pooling.mode == "mean_sqrt_len_tokens":
                vector = (hidden * mask).sum(1) / lengths.clamp(min=1e-9).sqrt()
            elif pooling.mode == "max":
                vector = hidden.masked_fill(mask == 0, -1e9).max(1).values
            else:  # lasttoken, right padding: the last position whose mask is 1
                last = attention_mask.sum(1) - 1
                vector = hidden[torch.arange(hidden.shape[0]), last]
            if pooling.normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=1)
            return vector, attention_mask.sum(1, keepdim=True)

    return PooledEncoder(model)


def tokenizer_traits(tokenizer_json: str) -> tuple[bool, int | None]:
    """(word-aware, unknown-token id) of a Rust tokenizer, as transformers' NER pipeline tells words apart:
    a model with a continuing-subword prefix ("##") marks sub-words itself; others need a heuristic."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    word_aware = bool(getattr(tok.model, "continuing_subword_prefix", None))
    unk = getattr(tok.model, "unk_token", None)
    return word_aware, (tok.token_to_id(unk) if unk else None)


def _ner_entry(opts, *, tokenizer_json: str, aggregation: str, labels: list[str], **kwargs):
    word_aware, unk_id = tokenizer_traits(tokenizer_json)
    if not word_aware and aggregation in WORD_STRATEGIES:
        log.warning("note: this tokenizer marks no sub-words; %s aggregation tells words apart by spaces, as the "
                    "transformers pipeline does", aggregation)
    return token_classification_entry(opts, tokenizer_json=tokenizer_json,
                                      rules=EntityRules(labels, aggregation, word_aware, unk_id), **kwargs)


def _classification(ckpt: Checkpoint, aggregation: str) -> TaskSpec:
    entry = functools.partial(classification_entry, labels=ckpt.labels, problem_type=ckpt.config.get("problem_type"))
    return TaskSpec(("logits",), lambda model, _ckpt: model, entry, metadata={"labels": ckpt.labels})


def _embedding(ckpt: Checkpoint, aggregation: str) -> TaskSpec:
    pooling = read_pooling(ckpt.path)
    dimensions = int(ckpt.config.get("hidden_size") or ckpt.config.get("d_model") or 0)
    if not dimensions:
        raise ExportError(f"{ckpt.path / 'config.json'} records no hidden_size; cannot size the embedding output")
    return TaskSpec(
        ("embeddings", "token_count"),
        lambda model, _ckpt: pooled_encoder(model, pooling),
        functools.partial(embedding_entry, dimensions=dimensions),
        max_length=pooling.max_seq_length,
        metadata={"pooling": pooling.mode, "normalize": pooling.normalize, "embedding_size": dimensions},
    )


def _image_classification(ckpt: Checkpoint, aggregation: str) -> TaskSpec:
    entry = functools.partial(image_classification_entry, labels=ckpt.labels, problem_type=ckpt.config.get("problem_type"))
    return TaskSpec(("logits",), lambda model, _ckpt: model, entry, metadata={"labels": ckpt.labels})


def _token_classification(ckpt: Checkpoint, aggregation: str) -> TaskSpec:
    if aggregation not in STRATEGIES:
        raise ExportError(f"unknown --aggregation {aggregation!r}; valid: {', '.join(STRATEGIES)}")
    entry = functools.partial(_ner_entry, labels=ckpt.labels, aggregation=aggregation)
    return TaskSpec(("logits",), lambda model, _ckpt: model, entry, metadata={"labels": ckpt.labels, "aggregation": aggregation})


def _object_detection(ckpt: Checkpoint, aggregation: str) -> TaskSpec:
    if ckpt.config.get("model_type") in NOT_YET:
        raise ExportError(f"{ckpt.path / 'config.json'}: model_type {ckpt.config['model_type']!r} is not supported yet: "
                          f"{NOT_YET[ckpt.config['model_type']]}")
    if ckpt.config.get("model_type") not in DETR_FAMILY:
        raise ExportError(f"{ckpt.path / 'config.json'}: model_type {ckpt.config.get('model_type')!r} is not supported "
                          f"for object-detection; supported: {', '.join(DETR_FAMILY)}, and Ultralytics YOLO runs (best.pt)")
    queries = query_count(ckpt.config)
    if not isinstance(queries, int) or queries < 1:
        raise ExportError(f"{ckpt.path / 'config.json'} records no num_queries (YOLOS: num_detection_tokens); cannot "
                          "size the detector's outputs")
    entry = functools.partial(detection_entry, labels=ckpt.labels, detr=DetrOutputs(queries, top_k(ckpt.config)),
                              defaults=DETECTION_DEFAULTS)
    return TaskSpec(("logits", "pred_boxes"), lambda model, _ckpt: detector(model), entry,
                    metadata={"labels": ckpt.labels, "detection_defaults": DETECTION_DEFAULTS, "nms": False},
                    served_check=detections_parity)


def _encoder_task(name: str, build_spec: Callable[[Checkpoint, str], TaskSpec]) -> EncoderTask:
    declared = registry.TASKS[name]
    return EncoderTask(**{f.name: getattr(declared, f.name) for f in dataclasses.fields(Task)}, build_spec=build_spec)


# The encoder tasks export builds, by name: the registry's tasks with what each adds to the common export.
ENCODER_TASKS: dict[str, EncoderTask] = {task.name: task for task in (
    _encoder_task(TEXT_CLASSIFICATION, _classification),
    _encoder_task(TOKEN_CLASSIFICATION, _token_classification),
    _encoder_task(FEATURE_EXTRACTION, _embedding),
    _encoder_task(IMAGE_CLASSIFICATION, _image_classification),
    _encoder_task(OBJECT_DETECTION, _object_detection),
)}


def check_task(task: str) -> EncoderTask:
    """The encoder task named `task`; ExportError naming the supported ones."""
    if task not in ENCODER_TASKS:
        raise ExportError(f"unsupported task {task!r}; supported tasks: {', '.join(sorted(ENCODER_TASKS))}")
    return ENCODER_TASKS[task]


def inspect_checkpoint(path: str | Path, task: str) -> Checkpoint:
    """Check that `path` is a Hugging Face checkpoint for `task` (no weights are loaded here)."""
    declared = check_task(task)
    path = Path(path).expanduser()
    if not path.exists():
        raise ExportError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise ExportError(f"{path} is not a directory; pass the folder written by save_pretrained()")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ExportError(
            f"{path} is not a Hugging Face checkpoint: no config.json (pass the folder written by save_pretrained())"
        )
    config = read_json(config_path, "checkpoint")
    weights = find_weights(path)
    if weights is None:
        raise ExportError(f"no model weights in {path}: expected one of {', '.join(WEIGHT_FILES)}")
    if declared.image:
        if not (path / IMAGE_PROCESSOR_FILE).is_file():
            raise ExportError(f"no {IMAGE_PROCESSOR_FILE} in {path}: {task} needs the image processor beside the "
                              "model (image_processor.save_pretrained)")
    elif not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ExportError(f"no tokenizer in {path}: save the tokenizer beside the model (tokenizer.save_pretrained)")
    suffix = declared.arch_suffix
    architectures = config.get("architectures") or []
    matching = [a for a in architectures if isinstance(a, str) and a.endswith(suffix)]
    if not matching:
        found = ", ".join(map(str, architectures)) or "none recorded"
        raise ExportError(
            f"task {task} needs a *{suffix} model, but {config_path} names architectures: {found}"
        )
    return Checkpoint(path=path, task=task, config=config, architecture=matching[0], weights=weights)

"""Build the Triton models of one exported encoder entry: tokenizer -> model -> postprocess ensemble.

`--target cpu` runs the ONNX graph in a python-backend model with ONNX Runtime (what the CPU build of
tritonserver offers); `--target gpu` uses Triton's native `onnxruntime_onnx` backend with KIND_GPU
instance groups, and fixed-length padding so that requests batch on the GPU.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from core import contract
from core.entry_metadata import entry_metadata_json

from .model_config import (
    DynamicBatching,
    EnsembleStep,
    InstanceGroup,
    ModelConfig,
    TensorSpec,
    check_model_name,
)

PYTHON_MODELS = Path(__file__).parent / "python_models"
TARGETS = ("cpu", "gpu")


@dataclass(frozen=True)
class EntryOptions:
    """How the entry is served: where, how many model instances, how requests are batched."""

    name: str
    target: str = "cpu"
    instances: int = 1
    max_batch_size: int = 32
    max_queue_delay_us: int = 500
    # A bounded queue: past it Triton refuses at once (the gateway answers 503 + Retry-After) instead of
    # queueing without end; a request that waited longer than the timeout is refused too.
    max_queue_size: int = 256
    queue_timeout_us: int = 30_000_000
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_model_name(self.name)
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}; valid: {', '.join(TARGETS)}")
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if not 1 <= self.max_batch_size <= contract.MAX_BATCH_SIZE:
            raise ValueError(f"--max-batch-size must be in 1..{contract.MAX_BATCH_SIZE}, got {self.max_batch_size}")
        if min(self.max_queue_delay_us, self.max_queue_size, self.queue_timeout_us) < 0:
            raise ValueError("--max-queue-delay-us, --max-queue-size and --queue-timeout-us must be >= 0")
        if self.gpus and self.target != "gpu":
            raise ValueError("--gpus only applies to --target gpu")

    def batching(self) -> DynamicBatching:
        return DynamicBatching(max_queue_delay_microseconds=self.max_queue_delay_us, max_queue_size=self.max_queue_size,
                               queue_timeout_microseconds=self.queue_timeout_us)

    def step(self, kind: str) -> str:
        """The name of one of the entry's Triton models: tokenizer, preprocess, model or postprocess."""
        return f"{self.name}_{kind}"

    def model_names(self) -> list[str]:
        """Every name an entry of this name may use (an existing one blocks an export without --force)."""
        return [self.name, *(self.step(k) for k in ("tokenizer", "preprocess", "model", "postprocess"))]


@dataclass
class ModelDir:
    """One Triton model folder: its config and the files to place in it (relative path -> source)."""

    config: ModelConfig
    files: dict[str, Path | str] = field(default_factory=dict)


def _tokenizer_model(opts: EntryOptions, tokenizer_json: str, input_names: list[str], max_length: int,
                     pad_token_id: int) -> ModelDir:
    """TEXT -> token tensors, in a python-backend model running the checkpoint's Rust tokenizer."""
    config = ModelConfig(
        name=opts.step("tokenizer"),
        backend="python",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("TEXT", "TYPE_STRING", (1,)),),
        outputs=_token_tensors(input_names),
        instance_groups=(InstanceGroup(count=opts.instances),),
        dynamic_batching=opts.batching(),
        parameters={
            "max_length": str(max_length),
            "pad_token_id": str(pad_token_id),
            "output_names": json.dumps(input_names),
            # Fixed-length padding on GPU so that requests batch into one shape.
            "padding": "max_length" if opts.target == "gpu" else "longest",
        },
    )
    return ModelDir(config, {"1/model.py": PYTHON_MODELS / "tokenizer" / "model.py", "1/tokenizer.json": tokenizer_json})


def _token_tensors(input_names: list[str]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(n, "TYPE_INT64", (-1,)) for n in input_names)


def gpu_model_config(opts: EntryOptions, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                     platform: str, filename: str, parameters: dict | None = None) -> ModelConfig:
    """The `<name>_model` step as a native GPU model (onnxruntime_onnx, tensorrt_plan) on KIND_GPU instances."""
    return ModelConfig(
        name=opts.step("model"), platform=platform, default_model_filename=filename, max_batch_size=opts.max_batch_size,
        inputs=inputs, outputs=outputs,
        instance_groups=(InstanceGroup(count=opts.instances, kind="KIND_GPU", gpus=opts.gpus),),
        dynamic_batching=opts.batching(),
        parameters=parameters or {},
    )


def _onnx_model(opts: EntryOptions, onnx_path: Path, input_names: list[str], outputs: tuple[TensorSpec, ...],
                parity: dict, inputs: tuple[TensorSpec, ...] | None = None) -> ModelDir:
    """The ONNX graph: python-backend ONNX Runtime on CPU, native onnxruntime_onnx with KIND_GPU on GPU.
    Inputs are token tensors named `input_names` unless `inputs` says otherwise (images)."""
    inputs = inputs or _token_tensors(input_names)
    if opts.target == "gpu":
        config = gpu_model_config(opts, inputs, outputs, "onnxruntime_onnx", "model.onnx")
        files: dict[str, Path | str] = {"1/model.onnx": onnx_path}
    else:
        # Texts of different lengths give token tensors of different lengths. Triton's dynamic batcher groups
        # only equal shapes unless told that the model handles ragged ones, and model.py pads them to the
        # longest: without this, requests batched only when their texts tokenized to the same length.
        inputs = tuple(dataclasses.replace(t, allow_ragged_batch=True) if t.dims == (-1,) else t for t in inputs)
        config = ModelConfig(name=opts.step("model"), backend="python", max_batch_size=opts.max_batch_size, inputs=inputs,
                             outputs=outputs, instance_groups=(InstanceGroup(count=opts.instances),),
                             dynamic_batching=opts.batching())
        files = {"1/model.onnx": onnx_path, "1/model.py": PYTHON_MODELS / "onnx_cpu" / "model.py"}
    files["parity.json"] = json.dumps(parity, indent=2)
    return ModelDir(config, files)


def classification_entry(
    opts: EntryOptions,
    *,
    onnx_path: Path,
    tokenizer_json: str,
    input_names: list[str],
    labels: list[str],
    max_length: int,
    pad_token_id: int,
    problem_type: str | None,
    metadata: dict,
    parity: dict,
) -> list[ModelDir]:
    """The four models of a text-classification entry; the ensemble carries the gateway's metadata."""
    tokenizer = _tokenizer_model(opts, tokenizer_json, input_names, max_length, pad_token_id)
    model = _onnx_model(opts, onnx_path, input_names, (TensorSpec("logits", "TYPE_FP32", (len(labels),)),), parity)
    postprocess = _classification_postprocess(opts, labels, problem_type)
    # What the gateway needs to serve the entry, read through Triton's model-config API.
    params = {contract.PARAM_TASK: contract.TEXT_CLASSIFICATION, contract.PARAM_LABELS: json.dumps(labels),
              contract.PARAM_MAX_LENGTH: str(max_length)}
    ensemble = _classifier_ensemble(opts, "TEXT", tokenizer.config.name, input_names, postprocess, params)
    return [ModelDir(ensemble, {"rtxserve.json": entry_metadata_json(metadata)}), tokenizer, model, postprocess]


def _classifier_ensemble(opts: EntryOptions, source: str, first_step: str, tensors: list[str], postprocess: ModelDir,
                         parameters: dict) -> ModelConfig:
    """`source` (BYTES) -> first step (its `tensors`) -> model (logits) -> the classification postprocess."""
    return ModelConfig(
        name=opts.name,
        platform="ensemble",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec(source, "TYPE_STRING", (1,)),),
        outputs=postprocess.config.outputs,
        ensemble_steps=(
            EnsembleStep(first_step, {source: source}, {n: n for n in tensors}),
            EnsembleStep(opts.step("model"), {n: n for n in tensors}, {"logits": "LOGITS"}),
            EnsembleStep(postprocess.config.name, {"LOGITS": "LOGITS"}, {o.name: o.name for o in postprocess.config.outputs}),
        ),
        parameters=parameters,
    )


def _classification_postprocess(opts: EntryOptions, labels: list[str], problem_type: str | None) -> ModelDir:
    """LOGITS -> PROBS (softmax, or sigmoid for multi-label), LABEL and SCORE."""
    num_labels = len(labels)
    config = ModelConfig(
        name=opts.step("postprocess"),
        backend="python",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("LOGITS", "TYPE_FP32", (num_labels,)),),
        outputs=(
            TensorSpec("PROBS", "TYPE_FP32", (num_labels,)),
            TensorSpec("LABEL", "TYPE_STRING", (1,)),
            TensorSpec("SCORE", "TYPE_FP32", (1,)),
        ),
        instance_groups=(InstanceGroup(count=1),),
        dynamic_batching=opts.batching(),
        parameters={"labels": json.dumps(labels), "problem_type": problem_type or "single_label_classification"},
    )
    return ModelDir(config, {"1/model.py": PYTHON_MODELS / "classification_postprocess" / "model.py"})


def embedding_entry(
    opts: EntryOptions,
    *,
    onnx_path: Path,
    tokenizer_json: str,
    input_names: list[str],
    dimensions: int,
    max_length: int,
    pad_token_id: int,
    metadata: dict,
    parity: dict,
) -> list[ModelDir]:
    """tokenizer -> model (pooling and normalisation are inside the graph): EMBEDDINGS and TOKENS per text."""
    tok_name, model_name = opts.step("tokenizer"), opts.step("model")
    outputs = (TensorSpec("embeddings", "TYPE_FP32", (dimensions,)), TensorSpec("token_count", "TYPE_INT64", (1,)))
    ensemble = ModelConfig(
        name=opts.name,
        platform="ensemble",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("TEXT", "TYPE_STRING", (1,)),),
        outputs=(TensorSpec("EMBEDDINGS", "TYPE_FP32", (dimensions,)), TensorSpec("TOKENS", "TYPE_INT64", (1,))),
        ensemble_steps=(
            EnsembleStep(tok_name, {"TEXT": "TEXT"}, {n: n for n in input_names}),
            EnsembleStep(model_name, {n: n for n in input_names}, {"embeddings": "EMBEDDINGS", "token_count": "TOKENS"}),
        ),
        parameters={
            contract.PARAM_TASK: contract.FEATURE_EXTRACTION,
            contract.PARAM_DIMENSIONS: str(dimensions),
            contract.PARAM_MAX_LENGTH: str(max_length),
        },
    )
    return [
        ModelDir(ensemble, {"rtxserve.json": entry_metadata_json(metadata)}),
        _tokenizer_model(opts, tokenizer_json, input_names, max_length, pad_token_id),
        _onnx_model(opts, onnx_path, input_names, outputs, parity),
    ]


@dataclass(frozen=True)
class EntityRules:
    """How the postprocess step turns per-token labels into entities: the label names, the default aggregation,
    whether the tokenizer marks sub-words (else words are told apart by spaces) and its unknown token's id."""

    labels: list[str]
    aggregation: str
    word_aware: bool
    unk_token_id: int | None


def token_classification_entry(
    opts: EntryOptions,
    *,
    onnx_path: Path,
    tokenizer_json: str,
    input_names: list[str],
    rules: EntityRules,
    max_length: int,
    pad_token_id: int,
    metadata: dict,
    parity: dict,
) -> list[ModelDir]:
    """tokenizer -> model (per-token logits) -> postprocess (entity spans with character offsets, as JSON)."""
    labels, aggregation = rules.labels, rules.aggregation
    tok_name, model_name, post_name = opts.step("tokenizer"), opts.step("model"), opts.step("postprocess")
    num_labels = len(labels)
    model = _onnx_model(opts, onnx_path, input_names, (TensorSpec("logits", "TYPE_FP32", (-1, num_labels)),), parity)
    entities = TensorSpec("ENTITIES", "TYPE_STRING", (1,))
    postprocess = ModelConfig(
        name=opts.step("postprocess"),
        backend="python",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("TEXT", "TYPE_STRING", (1,)), TensorSpec("LOGITS", "TYPE_FP32", (-1, num_labels))),
        outputs=(entities,),
        instance_groups=(InstanceGroup(count=1),),
        dynamic_batching=opts.batching(),
        parameters={
            "labels": json.dumps(labels),
            "aggregation": aggregation,
            "word_aware": "true" if rules.word_aware else "false",
            "unk_token_id": "" if rules.unk_token_id is None else str(rules.unk_token_id),
            "max_length": str(max_length),
        },
    )
    ensemble = ModelConfig(
        name=opts.name,
        platform="ensemble",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("TEXT", "TYPE_STRING", (1,)),),
        outputs=(entities,),
        ensemble_steps=(
            EnsembleStep(tok_name, {"TEXT": "TEXT"}, {n: n for n in input_names}),
            EnsembleStep(model_name, {n: n for n in input_names}, {"logits": "LOGITS"}),
            EnsembleStep(post_name, {"TEXT": "TEXT", "LOGITS": "LOGITS"}, {"ENTITIES": "ENTITIES"}),
        ),
        parameters={
            contract.PARAM_TASK: contract.TOKEN_CLASSIFICATION,
            contract.PARAM_LABELS: json.dumps(labels),
            contract.PARAM_AGGREGATION: aggregation,
            contract.PARAM_MAX_LENGTH: str(max_length),
        },
    )
    post_dir = PYTHON_MODELS / "ner_postprocess"
    return [
        ModelDir(ensemble, {"rtxserve.json": entry_metadata_json(metadata)}),
        _tokenizer_model(opts, tokenizer_json, input_names, max_length, pad_token_id),
        model,
        ModelDir(postprocess, {"1/model.py": post_dir / "model.py", "1/entities.py": post_dir / "entities.py",
                               "1/tokenizer.json": tokenizer_json}),
    ]


def image_classification_entry(
    opts: EntryOptions,
    *,
    onnx_path: Path,
    image_processor: dict,
    pixel_shape: tuple[int, int, int],
    labels: list[str],
    problem_type: str | None,
    metadata: dict,
    parity: dict,
) -> list[ModelDir]:
    """preprocess (encoded PNG/JPEG bytes -> pixel_values, the checkpoint's image-processor settings) ->
    model -> the classification postprocess."""
    pixels = TensorSpec("pixel_values", "TYPE_FP32", pixel_shape)
    preprocess = ModelConfig(
        name=opts.step("preprocess"),
        backend="python",
        max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("IMAGE", "TYPE_STRING", (1,)),),
        outputs=(pixels,),
        instance_groups=(InstanceGroup(count=opts.instances),),
        dynamic_batching=opts.batching(),
        parameters={"image_processor": json.dumps(image_processor)},
    )
    model = _onnx_model(opts, onnx_path, ["pixel_values"], (TensorSpec("logits", "TYPE_FP32", (len(labels),)),), parity,
                        inputs=(pixels,))
    postprocess = _classification_postprocess(opts, labels, problem_type)
    ensemble = _classifier_ensemble(opts, "IMAGE", preprocess.name, ["pixel_values"], postprocess,
                                    {contract.PARAM_TASK: contract.IMAGE_CLASSIFICATION,
                                     contract.PARAM_LABELS: json.dumps(labels)})
    pre_dir = PYTHON_MODELS / "image_preprocess"
    return [
        ModelDir(ensemble, {"rtxserve.json": entry_metadata_json(metadata)}),
        ModelDir(preprocess, {"1/model.py": pre_dir / "model.py", "1/imaging.py": pre_dir / "imaging.py"}),
        model,
        postprocess,
    ]


@dataclass(frozen=True)
class DetrOutputs:
    """A DETR-family graph's outputs: `queries` rows of logits and boxes; the logits read with DETR's softmax and its
    trailing no-object class (`top_k` None), or, for a detector trained with a sigmoid focal loss, a sigmoid per
    class and the best `top_k` (query, class) pairs."""

    queries: int
    top_k: int | None = None


def _detector_outputs(labels: list[str], defaults: dict, detr: DetrOutputs | None,
                      letterbox: dict | None) -> tuple[tuple[TensorSpec, ...], dict]:
    """The detector graph's outputs and the postprocess's decoder parameters that read them: a DETR's logits and
    boxes per query, a YOLO's output0 (its anchors follow the letterboxed size), or the boxes its graph's NMS kept."""
    if letterbox is None:
        # A fixed count of queries: the CPU model step cuts outputs whose first dim is -1 to the input's sequence length.
        raw = (TensorSpec("logits", "TYPE_FP32", (detr.queries, len(labels) + (detr.top_k is None))),
               TensorSpec("pred_boxes", "TYPE_FP32", (detr.queries, 4)))
        return raw, {"decoder": "detr"} if detr.top_k is None else {"decoder": "top_k", "top_k": str(detr.top_k)}
    if "graph_nms" in defaults:  # Ultralytics' graph with NMS in it: images -> output0, the kept boxes
        return ((TensorSpec("output0", "TYPE_FP32", (defaults["graph_nms"]["max_det"], 6)),),
                {"decoder": "yolo_nms", "letterbox": json.dumps(letterbox)})
    # Ultralytics' graph: images -> output0
    return ((TensorSpec("output0", "TYPE_FP32", (4 + len(labels), -1)),),
            {"decoder": "yolo", "letterbox": json.dumps(letterbox)})


def detection_entry(
    opts: EntryOptions,
    *,
    onnx_path: Path,
    image_processor: dict,
    pixel_shape: tuple[int, int, int],
    labels: list[str],
    defaults: dict,
    metadata: dict,
    parity: dict,
    detr: DetrOutputs | None = None,
    letterbox: dict | None = None,
) -> list[ModelDir]:
    """preprocess (encoded image -> pixel_values and the image's size) -> model -> postprocess (boxes in the image's
    pixels over the request's conf, at most its max_det). The request's OPTIONS (conf, iou, max_det) travel beside
    the image; the ensemble answers DETECTIONS and IMAGE_SIZE.

    A DETR-family model (`detr`) answers `logits` and `pred_boxes` for a fixed count of queries; an Ultralytics YOLO (given
    its `letterbox`: imgsz and stride, as the preprocess step's) answers `output0`, whose anchors follow the
    letterboxed image's size, and its postprocess runs NMS; or, exported with NMS in its graph (`graph_nms` in its
    `defaults`: its conf floor, iou and max_det), the boxes NMS kept, which its postprocess only filters and scales
    back."""
    pixels = TensorSpec("pixel_values", "TYPE_FP32", pixel_shape)
    size = TensorSpec("image_size", "TYPE_INT64", (2,))
    options = TensorSpec("OPTIONS", "TYPE_FP32", (3,))
    raw, decoder = _detector_outputs(labels, defaults, detr, letterbox)
    graph_input = TensorSpec("pixel_values" if letterbox is None else "images", "TYPE_FP32", pixel_shape)
    detections = TensorSpec("DETECTIONS", "TYPE_FP32", (-1, 6))
    preprocess = ModelConfig(
        name=opts.step("preprocess"), backend="python", max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("IMAGE", "TYPE_STRING", (1,)),), outputs=(pixels, size),
        instance_groups=(InstanceGroup(count=opts.instances),), dynamic_batching=opts.batching(),
        parameters={"image_processor": json.dumps(image_processor)},
    )
    model = _onnx_model(opts, onnx_path, [graph_input.name], raw, parity, inputs=(graph_input,))
    postprocess = ModelConfig(
        name=opts.step("postprocess"), backend="python", max_batch_size=opts.max_batch_size,
        inputs=(*raw, size, options), outputs=(detections,),
        instance_groups=(InstanceGroup(count=1),), dynamic_batching=opts.batching(), parameters=decoder,
    )
    raw_names = {t.name: t.name for t in raw}
    ensemble = ModelConfig(
        name=opts.name, platform="ensemble", max_batch_size=opts.max_batch_size,
        inputs=(TensorSpec("IMAGE", "TYPE_STRING", (1,)), options),
        outputs=(detections, TensorSpec("IMAGE_SIZE", "TYPE_INT64", (2,))),
        ensemble_steps=(
            EnsembleStep(preprocess.name, {"IMAGE": "IMAGE"}, {"pixel_values": "pixel_values", "image_size": "IMAGE_SIZE"}),
            EnsembleStep(opts.step("model"), {graph_input.name: "pixel_values"}, raw_names),
            EnsembleStep(postprocess.name, {**raw_names, "image_size": "IMAGE_SIZE", "OPTIONS": "OPTIONS"},
                         {"DETECTIONS": "DETECTIONS"}),
        ),
        parameters={contract.PARAM_TASK: contract.OBJECT_DETECTION, contract.PARAM_LABELS: json.dumps(labels),
                    contract.PARAM_DEFAULTS: json.dumps(defaults)},
    )
    pre_dir, post_dir = PYTHON_MODELS / "image_preprocess", PYTHON_MODELS / "detection_postprocess"
    post_files = {"1/model.py": post_dir / "model.py", "1/detections.py": post_dir / "detections.py"}
    if letterbox is not None:
        post_files["1/imaging.py"] = pre_dir / "imaging.py"
    return [
        ModelDir(ensemble, {"rtxserve.json": entry_metadata_json(metadata)}),
        ModelDir(preprocess, {"1/model.py": pre_dir / "model.py", "1/imaging.py": pre_dir / "imaging.py"}),
        model,
        ModelDir(postprocess, post_files),
    ]

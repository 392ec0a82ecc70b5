"""The task registry: every task rtxserve serves, declared once, with what export, the gateway and the load
tests need to know of it. Nothing here imports torch: the gateway and the load tests read it too.

A task's name is spelled only here (the constants below are the names); export builds it with the module
`kind` names (export/encoders/, export/llm/, export/diffusion/, export/speech/), the gateway serves it on `routes`, and
`rtxserve loadtest --scenario` drives it with the scenarios in `loadtest`. Adding a task is one entry here
plus its own module.
"""

from __future__ import annotations

from dataclasses import dataclass


# Model kinds: which export builds a task's models and which server runs them (a deployment's `kind:`).
ENCODER = "encoder"  # ONNX + a Triton ensemble
LLM = "llm"  # a vLLM engine
DIFFUSION = "diffusion"  # a Triton python-backend pipeline
SPEECH = "speech"  # a vLLM engine serving a speech-to-text model (Whisper)
KINDS = (ENCODER, LLM, DIFFUSION, SPEECH)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # one of KINDS
    inputs: str  # what a request carries: "text", "image", "prompt" or "audio"
    routes: tuple[str, ...]  # the gateway routes that serve it
    loadtest: tuple[str, ...]  # the load-test scenarios that drive it, one per route
    parity: str  # what export (or its tests) holds the served model to
    arch_suffix: str | None = None  # encoders: how the checkpoint's architecture name ends
    auto_class: str | None = None  # the transformers Auto class that loads the checkpoint
    peft_task_type: str | None = None  # the task_type a PEFT adapter for it records (None: it may record none)


TASKS: dict[str, Task] = {}


def _task(name: str, **fields) -> str:
    TASKS[name] = Task(name, **fields)
    return name


TEXT_CLASSIFICATION = _task(
    "text-classification", kind=ENCODER, inputs="text", routes=("/v1/classify",), loadtest=("classify",),
    parity="logits within atol of PyTorch", arch_suffix="ForSequenceClassification",
    auto_class="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS")
TOKEN_CLASSIFICATION = _task(
    "token-classification", kind=ENCODER, inputs="text", routes=("/v1/ner",), loadtest=("ner",),
    parity="logits within atol; entities as transformers' pipeline", arch_suffix="ForTokenClassification",
    auto_class="AutoModelForTokenClassification", peft_task_type="TOKEN_CLS")
# A bare encoder (BertModel, XLMRobertaModel, ...), as sentence-transformers saves it.
FEATURE_EXTRACTION = _task(
    "feature-extraction", kind=ENCODER, inputs="text", routes=("/v1/embeddings",), loadtest=("embeddings",),
    parity="vectors within atol of sentence-transformers", arch_suffix="Model", auto_class="AutoModel",
    peft_task_type="FEATURE_EXTRACTION")
# ViT, DeiT, BEiT, ConvNeXt, ResNet, ... with their image processor's preprocessor_config.json; peft has no
# task type for it, so such adapters record none.
IMAGE_CLASSIFICATION = _task(
    "image-classification", kind=ENCODER, inputs="image", routes=("/v1/classify",), loadtest=("image",),
    parity="logits within atol; labels as transformers' pipeline", arch_suffix="ForImageClassification",
    auto_class="AutoModelForImageClassification")
# DETR and the DETR family (Conditional DETR, RT-DETR) with their image processor: boxes and classes per image.
OBJECT_DETECTION = _task(
    "object-detection", kind=ENCODER, inputs="image", routes=("/v1/detect",), loadtest=("detect",),
    parity="raw outputs within atol; boxes, classes and scores as transformers' pipeline",
    arch_suffix="ForObjectDetection", auto_class="AutoModelForObjectDetection")
TEXT_GENERATION = _task(
    "text-generation", kind=LLM, inputs="prompt", routes=("/v1/chat/completions", "/v1/completions"),
    loadtest=("chat", "completions"), parity="merged logits within atol of base + adapter",
    auto_class="AutoModelForCausalLM", peft_task_type="CAUSAL_LM")
# Cross-encoders (a *ForSequenceClassification with one label, as sentence-transformers' CrossEncoder saves them),
# served by vLLM: a relevance score per (query, document) pair. Deployed as `kind: llm` (vLLM picks its pooling
# runner from the architecture); `/v2/rerank` (Cohere's shape) and vLLM's unversioned paths are served too.
TEXT_RANKING = _task(
    "text-ranking", kind=LLM, inputs="text", routes=("/v1/rerank", "/v1/score"), loadtest=("rerank", "score"),
    parity="scores as sentence-transformers' CrossEncoder.predict",
    auto_class="AutoModelForSequenceClassification")
TEXT_TO_IMAGE = _task(
    "text-to-image", kind=DIFFUSION, inputs="prompt", routes=("/v1/images/generations",), loadtest=("images",),
    parity="the served PNG equals the pipeline run in-process, same seed")

# Whisper (WhisperForConditionalGeneration) fine-tunes, served by vLLM: OpenAI's audio API, multipart uploads.
SPEECH_RECOGNITION = _task(
    "automatic-speech-recognition", kind=SPEECH, inputs="audio",
    routes=("/v1/audio/transcriptions", "/v1/audio/translations"), loadtest=("transcribe", "translate"),
    parity="the served transcript is the text transformers' pipeline writes (greedy) of the same audio",
    auto_class="AutoModelForSpeechSeq2Seq")


def of_kind(kind: str) -> tuple[str, ...]:
    return tuple(name for name, t in TASKS.items() if t.kind == kind)


def routes_by_scenario(*kinds: str, tasks: tuple[str, ...] = ()) -> dict[str, str]:
    """Load-test scenario -> the route it calls, for the tasks of these kinds and the tasks named."""
    return {scenario: route for t in TASKS.values() if t.kind in kinds or t.name in tasks
            for scenario, route in zip(t.loadtest, t.routes)}

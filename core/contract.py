"""What export writes and serve reads, declared once: task names, the parameters a Triton entry's config
carries for the gateway, vLLM's LoRA limits, the servers' default ports and the limits every side checks.
Both sides import this module and nothing of each other."""

from __future__ import annotations

# Tasks: how an entry (or a vLLM model) says what it does; declared in the registry (core/tasks.py).
from .tasks import (FEATURE_EXTRACTION, IMAGE_CLASSIFICATION, OBJECT_DETECTION, SPEECH_RECOGNITION,  # noqa: F401
                    TEXT_CLASSIFICATION, TEXT_GENERATION, TEXT_RANKING, TEXT_TO_IMAGE, TOKEN_CLASSIFICATION, ENCODER, of_kind)

ENCODER_TASKS = of_kind(ENCODER)

# Default ports: Triton's and vLLM's own choices (vLLM's moved off its 8000, which Triton takes), the gateway's.
GATEWAY_PORT = 8080
TRITON_HTTP_PORT, TRITON_GRPC_PORT, TRITON_METRICS_PORT = 8000, 8001, 8002
VLLM_PORT = 8100  # engine i of a deployment listens on VLLM_PORT + i

# The largest batch a Triton entry may take (export's --max-batch-size, the tuner, the deployment file).
MAX_BATCH_SIZE = 4096
# vLLM on CPU: the KV cache it reserves (VLLM_CPU_KVCACHE_SPACE), GiB, unless told otherwise.
CPU_KV_CACHE_GIB = 1.0

# Parameters in a servable Triton entry's config.pbtxt (string values).
PARAM_TASK = "rtxserve_task"  # one of the tasks above; entries without it are internal steps
PARAM_LABELS = "rtxserve_labels"  # JSON list, index = class id
PARAM_DIMENSIONS = "rtxserve_dimensions"  # embedding size
PARAM_AGGREGATION = "rtxserve_aggregation"  # NER default aggregation
PARAM_DEFAULTS = "rtxserve_defaults"  # JSON: what a request gets when it names no value (generation, detection)
PARAM_MAX_LENGTH = "rtxserve_max_length"  # the entry's token limit (texts are truncated to it)
PARAM_TENSORRT_VERSION = "rtxserve_tensorrt_version"  # a plan's TensorRT, which must load it (serve checks it)
PARAM_COMPUTE_CAPABILITY = "rtxserve_compute_capability"  # the GPU architecture a plan was built for

# Diffusion schedulers a request may choose: name -> diffusers class.
SCHEDULERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "dpm++": "DPMSolverMultistepScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler"}

# vLLM's LoRA limits: the ranks --max-lora-rank accepts (the largest is the maximum).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORA_RANK = LORA_RANKS[-1]


def padded_lora_rank(rank: int) -> int:
    """The LoRA rank vLLM sizes its slots for (--max-lora-rank takes only LORA_RANKS) for adapters up to `rank`."""
    return next((r for r in LORA_RANKS if r >= rank), MAX_LORA_RANK)


# Speech: the audio files soundfile (libsndfile) reads, which the gateway takes as uploads (export and the load
# tests pick sample files by them).
AUDIO_SUFFIXES = (".flac", ".mp3", ".ogg", ".wav")

# Object detection: the most detections a request may ask for per image (max_det), and each entry's defaults.
MAX_DETECTIONS = 1000
DETECTION_DEFAULTS = {"conf": 0.5, "iou": 0.7, "max_det": 100}  # conf: the pipeline's threshold

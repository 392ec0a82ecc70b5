"""What export writes and serve reads, declared once: task names, the parameters a Triton entry's config
carries for the gateway, and vLLM's LoRA limits. Both sides import this module and nothing of each other."""

from __future__ import annotations

# Tasks: how an entry (or a vLLM model) says what it does; declared in the registry (rtxserve/tasks.py).
from .tasks import (FEATURE_EXTRACTION, IMAGE_CLASSIFICATION, TEXT_CLASSIFICATION, TEXT_GENERATION,  # noqa: F401
                    TEXT_TO_IMAGE, TOKEN_CLASSIFICATION, of_kind)

ENCODER_TASKS = of_kind("encoder")

# Parameters in a servable Triton entry's config.pbtxt (string values).
PARAM_TASK = "rtxserve_task"  # one of the tasks above; entries without it are internal steps
PARAM_LABELS = "rtxserve_labels"  # JSON list, index = class id
PARAM_DIMENSIONS = "rtxserve_dimensions"  # embedding size
PARAM_AGGREGATION = "rtxserve_aggregation"  # NER default aggregation
PARAM_DEFAULTS = "rtxserve_defaults"  # JSON: what a generation request gets when it names no value

# Diffusion schedulers a request may choose: name -> diffusers class.
SCHEDULERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "dpm++": "DPMSolverMultistepScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler"}

# vLLM's LoRA limits: the ranks --max-lora-rank accepts (the largest is the maximum).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORA_RANK = LORA_RANKS[-1]


def padded_lora_rank(rank: int) -> int:
    """The LoRA rank vLLM sizes its slots for (--max-lora-rank takes only LORA_RANKS) for adapters up to `rank`."""
    return next((r for r in LORA_RANKS if r >= rank), MAX_LORA_RANK)

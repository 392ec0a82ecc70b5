"""The gateway's Triton client for image generation: the request it builds and how it reads the answer."""

import asyncio

import numpy as np
import pytest

from serve.gateway.backends.base import ModelInfo
from serve.gateway.backends.triton import TritonBackend
from serve.gateway.exceptions import BackendError

from .fakes import infer_response

MODEL = ModelInfo("sd", "text-to-image", "triton", True)
PARAMS = {"prompt": "a cat", "negative_prompt": "", "steps": 4, "guidance": 7.5, "seed": 3, "width": 64, "height": 64,
          "n": 2, "scheduler": "ddim", "lora_scale": 1.0}
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8


def _backend(images, truncated=5):
    sent = []

    async def infer(request, timeout):
        sent.append(request)
        return infer_response(request, {"IMAGES": np.array(images, dtype=np.object_),
                                        "PROMPT_TRUNCATED": np.array([truncated], dtype=np.int32)})

    backend = TritonBackend("unused:1")
    backend._infer = infer
    return backend, sent


def test_generation_sends_every_parameter_and_reads_the_pngs_and_truncation():
    backend, sent = _backend([PNG, PNG])
    images, truncated = asyncio.run(backend.generate_images(MODEL, PARAMS, 5.0))
    assert images == [PNG, PNG] and truncated == 5
    (request,) = sent
    assert [i.name for i in request.inputs][:3] == ["PROMPT", "NEGATIVE_PROMPT", "STEPS"]
    assert [o.name for o in request.outputs] == ["IMAGES", "PROMPT_TRUNCATED"]


def test_fewer_images_than_asked_is_a_backend_error():
    backend, _ = _backend([PNG])
    with pytest.raises(BackendError, match="returned 1 images"):
        asyncio.run(backend.generate_images(MODEL, PARAMS, 5.0))

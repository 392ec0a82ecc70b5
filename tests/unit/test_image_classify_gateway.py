"""POST /v1/classify with base64 images, in-process with a fake backend: decoding, limits, and the
text/image mismatch errors; the Triton client sends the bytes as IMAGE."""

import asyncio
import base64

import pytest

from serve.gateway.backends.base import ModelInfo
from serve.gateway.backends.triton import TritonBackend

from .fakes import error_of, infer_response, request_inputs

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 20
JPEG = b"\xff\xd8\xff\xe0" + b"\x01" * 20


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_images_are_decoded_and_classified_in_order(client, backend):
    body = {"model": "vit", "input": [{"image": b64(PNG)}, {"image": f"data:image/jpeg;base64,{b64(JPEG)}"}]}
    r = client.post("/v1/classify", json=body)
    assert r.status_code == 200, r.text
    assert [(d["index"], d["label"]) for d in r.json()["data"]] == [(0, "cat"), (1, "dog")]
    assert backend.calls == [[PNG, JPEG]]  # the backend got the raw file bytes


def test_a_single_image_object_is_one_input(client, backend):
    r = client.post("/v1/classify", json={"model": "vit", "input": {"image": b64(PNG)}})
    assert r.status_code == 200 and r.json()["data"][0]["label"] == "cat"


@pytest.mark.parametrize("image, message", [
    ("not base64!!", "image 0: the image is not valid base64"),
    ("not+base64", "image 0: the image is not valid base64 (its length is not a multiple of 4)"),
    (b64(b"GIF89a" + b"\x00" * 10), "image 0 is not a PNG or JPEG file"),
    ("data:image/png,rawbytes", "image 0: a data URL must read data:image/<type>;base64,<data>"),
    ("data:text/plain;base64," + b64(PNG), "image 0: a data URL must read data:image/<type>;base64,<data>"),
    (b64(PNG + b"\x00" * 200), "image 0: the image has 228 bytes; this gateway allows at most 100 per image"),
])  # the same rules and words as chat's image parts (serve/gateway/inputs/data_url.py)
def test_bad_images_are_400_and_never_reach_the_backend(backend, image, message):
    from fastapi.testclient import TestClient

    from serve.gateway.app import create_app
    from serve.gateway.settings import GatewaySettings

    settings = GatewaySettings(max_inputs=8, max_image_bytes=100, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as client:
        err = error_of(client.post("/v1/classify", json={"model": "vit", "input": [{"image": image}]}), 400)
    assert message in err["message"] and err["param"] == "input"
    assert backend.calls == []


def test_text_to_an_image_model_and_images_to_a_text_model_say_what_to_send(client, backend):
    err = error_of(client.post("/v1/classify", json={"model": "vit", "input": "a cat"}), 400)
    assert "classifies images" in err["message"] and '"image"' in err["message"]
    err = error_of(client.post("/v1/classify", json={"model": "clf", "input": [{"image": b64(PNG)}]}), 400)
    assert "classifies text" in err["message"]
    assert backend.calls == []


def test_too_many_images_and_unknown_fields_are_refused(client, backend):
    error_of(client.post("/v1/classify", json={"model": "vit", "input": [{"image": b64(PNG)}] * 9}), 400)
    error_of(client.post("/v1/classify", json={"model": "vit", "input": [{"image": b64(PNG), "url": "x"}]}), 422)
    assert backend.calls == []


def test_an_embedding_model_is_not_a_classifier(client):
    err = error_of(client.post("/v1/classify", json={"model": "emb", "input": "x"}), 400)
    assert "text-classification or image-classification" in err["message"]


class _Client:
    """Triton's ModelInfer: every image is a cat."""

    def __init__(self):
        self.inputs = []

    async def __call__(self, request, timeout):
        import numpy as np

        name, images = request_inputs(request)
        self.inputs.append((name, images))
        n = len(images)
        return infer_response(request, {"LABEL": np.array([[b"cat"]] * n, dtype=np.object_),
                                        "SCORE": np.ones((n, 1), np.float32), "PROBS": np.ones((n, 2), np.float32)})


def test_triton_client_sends_images_as_IMAGE_bytes_in_chunks():
    backend = TritonBackend("unused")
    backend._infer = _Client()
    info = ModelInfo("vit", "image-classification", "triton", True, ("cat", "dog"), 2)
    result = asyncio.run(backend.classify_images(info, [PNG, JPEG, PNG], 5.0))
    assert [r.label for r in result] == ["cat"] * 3
    assert backend._infer.inputs == [("IMAGE", [PNG, JPEG]), ("IMAGE", [PNG])]

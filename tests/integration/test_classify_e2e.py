"""Classification through the real gateway and the real tritonserver, checked against PyTorch."""

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from fixture_models.text import CLASSIFIER_PROBES
from serve.stack import start_gateway

from .conftest import DETECTOR, EMBEDDER, LORA_CLASSIFIER, MODEL, RT_DETR, TAGGER, VISION, YOLO, YOLOS

TEXTS = [
    *CLASSIFIER_PROBES,  # labelled with a margin, checked by the fixture's build
    "great excellent amazing",
    "worst refund awful",
    "my order shipped today",
    "Das Essen war großartig — très bien, 👍",
    "ok",
]


@pytest.fixture(scope="module")
def pytorch(classifier_checkpoint):
    """texts -> (softmax probabilities, the labels in order): the fixture classifier in PyTorch, truncating as the
    served tokenizer does."""
    tokenizer = AutoTokenizer.from_pretrained(classifier_checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_checkpoint).eval()

    def probs(texts: list[str]):
        with torch.no_grad():
            logits = model(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt")).logits
        return torch.softmax(logits, -1).numpy(), [model.config.id2label[i] for i in range(logits.shape[-1])]

    return probs


@pytest.fixture(scope="module")
def pytorch_probs(pytorch):
    return pytorch(TEXTS)


def test_gateway_labels_and_scores_match_pytorch(stack, pytorch_probs):
    probs, labels = pytorch_probs
    r = httpx.post(f"{stack.gateway_url}/v1/classify", json={"model": MODEL, "input": TEXTS}, timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["label"] for d in data] == [labels[i] for i in probs.argmax(-1)]
    served = np.array([[d["scores"][label] for label in labels] for d in data])
    np.testing.assert_allclose(served, probs, atol=1e-4)
    # the fixture was trained: its labels mean something (its build checked these with a margin)
    assert [d["label"] for d in data[:len(CLASSIFIER_PROBES)]] == list(CLASSIFIER_PROBES.values())


def test_requests_larger_than_max_batch_size_are_split_and_reassembled(stack, pytorch_probs):
    probs, labels = pytorch_probs
    texts = TEXTS * 5  # 40 texts > max_batch_size 32
    r = httpx.post(f"{stack.gateway_url}/v1/classify", json={"model": MODEL, "input": texts}, timeout=30)
    assert r.status_code == 200, r.text
    assert [d["label"] for d in r.json()["data"]] == [labels[i] for i in probs.argmax(-1)] * 5


def test_concurrent_requests_batched_by_triton_give_each_client_its_own_answer(stack, pytorch_probs):
    probs, labels = pytorch_probs
    expected = [labels[i] for i in probs.argmax(-1)]
    with httpx.Client(timeout=30) as client:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(client.post, f"{stack.gateway_url}/v1/classify", json={"model": MODEL, "input": [t]})
                       for t in TEXTS * 4]
            got = [f.result().json()["data"][0]["label"] for f in futures]
    assert got == expected * 4


def test_text_longer_than_max_length_is_truncated_not_rejected(stack, pytorch):
    text = "great " * 3000
    r = httpx.post(f"{stack.gateway_url}/v1/classify", json={"model": MODEL, "input": text}, timeout=30)
    assert r.status_code == 200, r.text
    probs, labels = pytorch([text])
    served = r.json()["data"][0]
    assert served["label"] == labels[probs[0].argmax()]
    np.testing.assert_allclose([served["scores"][label] for label in labels], probs[0], atol=1e-4)


def test_models_ready_metrics_and_errors_through_the_real_gateway(stack):
    url = stack.gateway_url
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert sorted((m["id"], m["task"], m["ready"]) for m in models) == sorted([
        (EMBEDDER, "feature-extraction", True), (MODEL, "text-classification", True),
        (TAGGER, "token-classification", True), (VISION, "image-classification", True),
        (DETECTOR, "object-detection", True), (RT_DETR, "object-detection", True), (YOLOS, "object-detection", True),
        (YOLO, "object-detection", True),
        (LORA_CLASSIFIER, "text-classification", True)])
    assert httpx.get(f"{url}/readyz").status_code == 200
    r = httpx.post(f"{url}/v1/classify", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{url}/v1/classify", json={"model": MODEL, "input": []}).status_code == 422
    assert httpx.get(f"{url}/v2/repository/index").status_code == 404  # Triton's admin API is not exposed
    metrics = httpx.get(f"{url}/metrics").text
    assert f'rtxserve_requests_total{{model="{MODEL}",route="/v1/classify",status="200"}}' in metrics


def test_gateway_with_its_backend_down_answers_503_fast_and_is_not_ready(tmp_path):
    from serve.launcher import free_port

    gateway, url = start_gateway(f"127.0.0.1:{free_port()}", tmp_path, wait_for="/healthz")
    try:
        assert httpx.get(f"{url}/readyz").status_code == 503
        r = httpx.post(f"{url}/v1/classify", json={"model": MODEL, "input": "x"}, timeout=5)
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert r.json()["error"]["type"] == "service_unavailable"
        # refused from what the gateway knows, without a call to the dead backend (how fast: bench reliability's R1)
        assert "is unknown while a backend is down" in r.json()["error"]["message"], r.text
    finally:
        gateway.stop()

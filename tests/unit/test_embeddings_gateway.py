"""POST /v1/embeddings in-process (ASGI, no sockets) with a fake backend, also through the openai SDK;
and the Triton client's chunking with a fake gRPC client."""

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
from prometheus_client import REGISTRY

from serve.gateway.backends.base import ModelInfo
from serve.gateway.backends.triton import TritonBackend
from serve.gateway.exceptions import BackendError, BackendUnavailable

from .fakes import DIM, MODELS, FakeGrpc, FakeTriton, vector
from .fakes import error_of as _error


@pytest.fixture
def backend():
    return FakeTriton([*MODELS, ModelInfo("emb-unsized", "feature-extraction", "triton", True)])


def test_floats_one_per_text_in_order_with_usage_summed(client, backend):
    texts = ["a b c", "hello", "one two"]
    r = client.post("/v1/embeddings", json={"model": "emb", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "emb"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
    for d, text in zip(body["data"], texts):
        assert np.array(d["embedding"], dtype=np.float32).tolist() == vector(text).tolist()
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert backend.calls == [texts]


def test_a_single_string_is_one_input(client, backend):
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "hello"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert backend.calls == [["hello"]]


def test_base64_is_the_little_endian_float32_bytes_of_the_floats(client):
    texts = ["x", "longer text"]
    floats = client.post("/v1/embeddings", json={"model": "emb", "input": texts}).json()["data"]
    encoded = client.post("/v1/embeddings", json={"model": "emb", "input": texts, "encoding_format": "base64"}).json()["data"]
    for f, e in zip(floats, encoded):
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.array(f["embedding"], dtype=np.float32).tolist()


def test_dimensions_equal_to_the_models_pass_and_others_are_400_naming_it(client, backend):
    assert client.post("/v1/embeddings", json={"model": "emb", "input": "x", "dimensions": DIM}).status_code == 200
    err = _error(client.post("/v1/embeddings", json={"model": "emb", "input": "x", "dimensions": 2}), 400)
    assert err["param"] == "dimensions" and f"{DIM} dimensions" in err["message"]
    assert len(backend.calls) == 1  # the refused request never reached the backend


def test_dimensions_are_checked_against_the_vectors_when_the_model_did_not_declare_its_size(client):
    assert client.post("/v1/embeddings", json={"model": "emb-unsized", "input": "x", "dimensions": DIM}).status_code == 200
    assert f"{DIM} dimensions" in _error(
        client.post("/v1/embeddings", json={"model": "emb-unsized", "input": "x", "dimensions": 8}), 400
    )["message"]


@pytest.mark.parametrize("tokens", [[1, 2, 3], [[1, 2], [3]]])
def test_token_arrays_are_400(client, backend, tokens):
    err = _error(client.post("/v1/embeddings", json={"model": "emb", "input": tokens}), 400)
    assert "token arrays are not supported" in err["message"] and err["param"] == "input"
    assert backend.calls == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "emb", "input": []}, "input"),
        ({"model": "emb", "input": ["ok", " "]}, "input"),
        ({"model": "emb", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "emb", "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": "emb", "input": "x", "user": "u" * 257}, "user"),
        ({"model": "emb", "input": "x", "temperature": 1}, "temperature"),
        ({"input": "x"}, "model"),
    ],
)
def test_malformed_requests_get_422_and_never_reach_the_backend(client, backend, body, param):
    err = _error(client.post("/v1/embeddings", json=body), 422)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert backend.calls == []


def test_user_is_accepted_and_ignored(client):
    assert client.post("/v1/embeddings", json={"model": "emb", "input": "x", "user": "someone"}).status_code == 200


def test_limits_on_count_and_length_are_400(client, backend):
    assert "at most 8 texts" in _error(client.post("/v1/embeddings", json={"model": "emb", "input": ["a"] * 9}), 400)["message"]
    assert "limit is 100" in _error(client.post("/v1/embeddings", json={"model": "emb", "input": ["a" * 101]}), 400)["message"]
    assert backend.calls == []


def test_unknown_model_is_404_and_a_classifier_is_the_wrong_task(client):
    assert _error(client.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404)["code"] == "model_not_found"
    err = _error(client.post("/v1/embeddings", json={"model": "clf", "input": "x"}), 400)
    assert "text-classification model, not feature-extraction" in err["message"] and err["param"] == "model"


def test_backend_down_is_503_with_retry_after(client, backend):
    backend.up = False
    client.portal.call(client.app.state.gateway.registry.refresh)
    r = client.post("/v1/embeddings", json={"model": "emb", "input": "x"})
    assert _error(r, 503)["code"] == "backend_unavailable" and int(r.headers["Retry-After"]) >= 1


def test_backend_unavailable_during_a_request_is_503(client, backend):
    backend.fail_with = BackendUnavailable("queue full")
    _error(client.post("/v1/embeddings", json={"model": "emb", "input": "x"}), 503)


def test_prompt_tokens_are_counted_in_metrics(client):
    def counted():
        return REGISTRY.get_sample_value("rtxserve_tokens_total", {"model": "emb", "kind": "prompt"}) or 0

    before = counted()
    client.post("/v1/embeddings", json={"model": "emb", "input": ["one two three", "four"]})
    assert counted() - before == 4
    text = client.get("/metrics").text
    assert 'rtxserve_request_duration_seconds_count{model="emb",route="/v1/embeddings",status="200"}' in text


def test_the_openai_sdk_gets_the_vectors_in_base64_by_default_and_as_floats(client):
    formats = []
    client.event_hooks["request"].append(lambda req: formats.append(json.loads(req.content).get("encoding_format")))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
    texts = ["first text", "second"]
    for kwargs in ({}, {"encoding_format": "float"}):
        result = sdk.embeddings.create(model="emb", input=texts, **kwargs)
        assert [np.float32(v) for v in result.data[0].embedding] == list(vector(texts[0]))
        assert [np.float32(v) for v in result.data[1].embedding] == list(vector(texts[1]))
        assert result.usage.prompt_tokens == result.usage.total_tokens == 3
    assert formats == ["base64", "float"]
    with pytest.raises(openai.BadRequestError, match="token arrays"):
        sdk.embeddings.create(model="emb", input=[[1, 2]])


def test_triton_embed_splits_at_max_batch_size_and_keeps_the_order():
    triton = TritonBackend("unused:0")
    triton._infer = FakeGrpc()
    info = ModelInfo("emb", "feature-extraction", "triton", True, (), 3, DIM)
    texts = ["a" * n for n in range(1, 8)]
    result = asyncio.run(triton.embed(info, texts, 1.0))
    assert triton._infer.batches == [3, 3, 1]
    assert [int(e.vector[0]) for e in result] == list(range(1, 8))
    assert {e.tokens for e in result} == {2} and result[0].vector.dtype == np.float32


def test_triton_embed_missing_rows_are_a_backend_error():
    triton = TritonBackend("unused:0")
    triton._infer = FakeGrpc(rows_short_by=1)
    info = ModelInfo("emb", "feature-extraction", "triton", True, (), 8, DIM)
    with pytest.raises(BackendError, match="1 EMBEDDINGS rows for 2 inputs"):
        asyncio.run(triton.embed(info, ["a", "b"], 1.0))


def test_triton_classify_shares_the_chunking():
    triton = TritonBackend("unused:0")
    triton._infer = FakeGrpc()
    info = ModelInfo("clf", "text-classification", "triton", True, ("only",), 2)
    result = asyncio.run(triton.classify(info, ["a", "bb", "ccc"], 1.0))
    assert triton._infer.batches == [2, 1]
    assert [c.label for c in result] == ["1", "2", "3"] and result[0].scores == {"only": 1.0}

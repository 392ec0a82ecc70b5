"""POST /v1/ner in-process (ASGI, no sockets) with a fake backend; and the Triton client's reading of the
postprocess model's JSON with a fake gRPC client."""

import asyncio
import pytest

from serve.gateway.backends.base import ModelInfo
from serve.gateway.backends.triton import TritonBackend
from serve.gateway.exceptions import BackendError

from .fakes import FakeGrpc, capitalised, error_of


def test_entities_per_text_with_offsets_in_order(client, backend):
    texts = ["Anna met Bob", "nobody here", "x " * 30 + "Zed"]
    r = client.post("/v1/ner", json={"model": "ner", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "ner" and body["aggregation"] == "first"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    first = body["data"][0]["entities"]
    assert [(e["entity"], e["start"], e["end"], e["word"]) for e in first] == [("PER", 0, 4, "Anna"), ("PER", 9, 12, "Bob")]
    assert "index" not in first[0]  # only aggregation none has token positions
    assert body["data"][1]["entities"] == [] and body["data"][1]["truncated"] is False
    assert body["data"][2]["truncated"] is True  # the client is told the tail was not tagged
    assert backend.calls == [texts] and backend.aggregations == ["first"]


def test_aggregation_per_request_reaches_the_backend(client, backend):
    r = client.post("/v1/ner", json={"model": "ner", "input": "Anna", "aggregation": "max"})
    assert r.status_code == 200 and r.json()["aggregation"] == "max"
    assert backend.aggregations == ["max"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "ner", "input": "a", "aggregation": "best"}, 422, "aggregation"),
    ({"model": "ner", "input": []}, 422, "input"),
    ({"model": "ner", "input": ["ok", "  "]}, 422, "input"),
    ({"model": "ner", "input": ["a"] * 9}, 400, "input"),
    ({"model": "ner", "input": "a" * 101}, 400, "input"),
    ({"model": "clf", "input": "a"}, 400, "model"),
    ({"model": "nope", "input": "a"}, 404, "model"),
])
def test_bad_requests_are_refused_before_the_backend(client, backend, body, status, param):
    err = error_of(client.post("/v1/ner", json=body), status)
    assert err["param"] == param
    assert backend.calls == []


def _tag(texts, **fake):
    backend = TritonBackend("unused")
    backend._infer = FakeGrpc(**fake)
    info = ModelInfo("ner", "token-classification", "triton", True, max_batch_size=2)
    return backend, asyncio.run(backend.tag(info, texts, "average", 5.0))


def test_triton_client_reads_the_postprocess_json_in_chunks_and_passes_the_strategy():
    texts = ["Anna", "no one", "Bob and Eve"]
    backend, result = _tag(texts)
    assert [r.entities for r in result] == [capitalised(t) for t in texts] and result[2].entities
    assert backend._infer.batches == [2, 1] and backend._infer.parameters == [{"aggregation": "average"}] * 2


def test_unreadable_postprocess_output_is_a_backend_error():
    with pytest.raises(BackendError, match="cannot read"):
        _tag(["Anna"], entities_json=False)

"""The gateway's answer cache (`response_cache_mb`, serve/gateway/fleet/answer_cache.py) on fake backends: an input seen before
never reaches the backend and gets the same answer; only the unseen rows of a request are sent; nothing that changes
an answer (the model that answers, NER's aggregation, the input's every byte) is ever shared, nor any answer across
keys' scopes; a cache over its bytes evicts, never grows; a failure keeps nothing; a model that stops being ready
loses its answers."""

import base64
import dataclasses
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import REGISTRY

from serve.gateway.access.keys import ApiKey, hash_key, write_keys
from serve.gateway.app import create_app
from serve.gateway.exceptions import BackendError
from serve.gateway.settings import GatewaySettings

from .fakes import MODELS, FakeTriton, error_of

# A model and its second version on fake Tritons of their own, named apart from other modules' (the metrics are global)
A, B = (dataclasses.replace(MODELS[0], name=name) for name in ("cached-a", "cached-b"))


@pytest.fixture
def backends():
    return FakeTriton(models=(A,), url="a"), FakeTriton(models=(B,), url="b")


def _client(backends, **settings):
    settings = {"health_interval_s": 60, "response_cache_mb": {"clf": 1, "emb": 1, "ner": 1, "vit": 1, "cached-a": 1,
                                                               "cached-b": 1},
                **settings}
    return TestClient(create_app(GatewaySettings(**settings), list(backends)), raise_server_exceptions=False)


def _looked_up(model: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("rtxserve_answer_cache_lookups_total", {"model": model, "outcome": outcome}) or 0.0


def _classify(client, texts, model="clf", **headers):
    r = client.post("/v1/classify", json={"model": model, "input": texts}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_a_seen_input_is_answered_by_the_gateway_and_only_unseen_rows_are_sent():
    backend = FakeTriton()
    hits, misses = _looked_up("clf", "hit"), _looked_up("clf", "miss")
    with _client([backend]) as client:
        first = _classify(client, ["good day", "bad day"])
        again = _classify(client, ["bad day", "good day"])
        mixed = _classify(client, ["a new good one", "good day", "a new good one", "bad day"])
    assert backend.calls == [["good day", "bad day"], ["a new good one"]]  # a repeat within a request: sent once
    assert again == [{**first[1], "index": 0}, {**first[0], "index": 1}]
    assert [d["label"] for d in mixed] == ["pos", "pos", "pos", "neg"] and [d["index"] for d in mixed] == [0, 1, 2, 3]
    assert (_looked_up("clf", "hit") - hits, _looked_up("clf", "miss") - misses) == (4, 4)


def test_every_task_with_rows_is_cached_and_each_answers_as_the_backend_did():
    backend = FakeTriton()
    png, jpeg = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
    images = [{"image": base64.b64encode(b.getvalue()).decode()} for b in (png, jpeg)]
    with _client([backend]) as client:
        answers = [[client.post(path, json=body).json() for _ in range(2)] for path, body in (
            ("/v1/embeddings", {"model": "emb", "input": ["one text", "another text"]}),
            ("/v1/ner", {"model": "ner", "input": ["Ada met Alan"]}),
            ("/v1/classify", {"model": "vit", "input": images}))]
    assert len(backend.calls) == 3  # each once
    for first, second in answers:
        assert first == {**second, **({"id": first["id"]} if "id" in first else {})}
    assert [d["label"] for d in answers[2][1]["data"]] == ["cat", "dog"]


def test_what_changes_an_answer_is_never_shared(backends):
    """NER's aggregation, the model that answers (an alias's targets), a byte of the input, a model with no cache."""
    backend = FakeTriton()
    with _client([backend], response_cache_mb={"ner": 1, "clf": 1}) as client:
        for aggregation in ("first", "simple", "first"):
            client.post("/v1/ner", json={"model": "ner", "input": "Ada met Alan", "aggregation": aggregation})
        for text in ("good", "good ", "Good", "good"):
            _classify(client, text)
        for _ in range(2):
            client.post("/v1/embeddings", json={"model": "emb", "input": "no cache for this model"})
    assert backend.aggregations == ["first", "simple"]
    assert backend.calls[2:] == [["good"], ["good "], ["Good"], ["no cache for this model"], ["no cache for this model"]]
    with _client(backends, aliases={"cached": {"cached-a": 50, "cached-b": 50}}) as client:
        named = [client.post("/v1/classify", json={"model": "cached", "input": "good"}).json()["model"]
                 for _ in range(40)]
    assert set(named) == {"cached-a", "cached-b"} and [len(b.calls) for b in backends] == [1, 1]  # each model's own


def test_keys_of_different_scopes_never_share_an_answer(tmp_path):
    backend = FakeTriton()
    scopes = {"a": ("clf",), "a-too": ("clf",), "b": ("clf", "emb"), "everything": ("*",), "admin": ()}
    write_keys(tmp_path / "keys.json", {n: ApiKey(name=n, hash=hash_key(f"rtx-{n}-secret"), models=m,
                                                  admin=n == "admin") for n, m in scopes.items()})
    with _client([backend], keys_file=tmp_path / "keys.json") as client:
        for name in scopes:
            _classify(client, "good", Authorization=f"Bearer rtx-{name}-secret")
        outside = client.post("/v1/embeddings", json={"model": "clf", "input": "good"},
                              headers={"Authorization": "Bearer rtx-a-secret"})
    assert len(backend.calls) == 3  # a and a-too share one scope, everything and admin another; b its own
    assert error_of(outside, 400)


def test_a_cache_over_its_bytes_evicts_the_least_recently_used_and_never_grows():
    backend = FakeTriton()
    limit = 0.01 * 2**20  # about 10 kB: some tens of rows
    with _client([backend], response_cache_mb={"clf": 0.01}) as client:
        _classify(client, "kept warm")
        for i in range(200):
            _classify(client, f"text number {i}")
            if i % 10 == 0:
                _classify(client, "kept warm")  # used again: never the least recently used
        metrics = client.get("/metrics").text
        _classify(client, "text number 0")
        _classify(client, "kept warm")
    kept = REGISTRY.get_sample_value("rtxserve_answer_cache_bytes", {"model": "clf"})
    evicted = REGISTRY.get_sample_value("rtxserve_answer_cache_evictions_total", {"model": "clf"})
    assert 0.5 * limit < kept <= limit and evicted >= 100
    assert "rtxserve_answer_cache_bytes" in metrics
    assert backend.calls[-1] == ["text number 0"] and ["kept warm"] not in backend.calls[1:]


def test_a_failed_call_keeps_nothing_and_a_model_that_stops_being_ready_forgets(backends):
    with _client(backends, fallbacks={"cached-a": ["cached-b"]}) as client:
        backends[0].fail_with = BackendError("the model failed")
        assert error_of(client.post("/v1/classify", json={"model": "cached-a", "input": "good"}), 502)
        backends[0].fail_with = None
        _classify(client, "good", "cached-a")
        _classify(client, "good", "cached-a")
        assert backends[0].calls == [["good"]]  # the failure kept nothing; the answer after it was kept
        backends[0].up = False
        client.portal.call(client.app.state.gateway.registry.refresh)
        assert client.post("/v1/classify", json={"model": "cached-a", "input": "good"}).json()["model"] == "cached-b"
        assert backends[1].calls == [["good"]]  # the fallback answered itself: a's answer is not b's
        backends[0].up = True
        client.portal.call(client.app.state.gateway.registry.refresh)
        _classify(client, "good", "cached-a")
    assert backends[0].calls == [["good"], ["good"]]  # a, gone and back, answers again


@pytest.mark.parametrize("mb, problem", [({"clf": -1}, "greater than or equal to 0"),
                                         ({"clf": 1e6}, "less than or equal to 65536")])
def test_a_cache_size_out_of_bounds_is_refused(mb, problem):
    with pytest.raises(ValueError, match=problem):
        GatewaySettings(response_cache_mb=mb)

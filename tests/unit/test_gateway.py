"""The gateway in-process (ASGI, no sockets) with a fake backend: validation, routing, errors, metrics."""

import pytest

from serve.gateway.exceptions import BackendUnavailable

from .fakes import error_of as _error

def test_classify_returns_one_result_per_text_in_order(client, backend):
    r = client.post("/v1/classify", json={"model": "clf", "input": ["good day", "bad day"]})
    assert r.status_code == 200
    data = r.json()["data"]
    assert [d["label"] for d in data] == ["pos", "neg"] and [d["index"] for d in data] == [0, 1]
    assert data[0]["scores"] == {"neg": 0.1, "pos": 0.9}
    assert backend.calls == [["good day", "bad day"]]


def test_a_single_string_is_one_input(client, backend):
    r = client.post("/v1/classify", json={"model": "clf", "input": "good"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "clf", "input": []}, "input"),
        ({"model": "clf", "input": ["ok", "   "]}, "input"),
        ({"model": "clf", "input": [1, 2]}, "input"),
        ({"model": "clf", "input": None}, "input"),
        ({"model": "clf"}, "input"),
        ({"input": ["x"]}, "model"),
        ({"model": "clf", "input": ["x"], "temperature": 1}, "temperature"),
    ],
)
def test_malformed_requests_get_422_and_never_reach_the_backend(client, backend, body, param):
    err = _error(client.post("/v1/classify", json=body), 422)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert backend.calls == []


def test_non_json_body_is_422(client, backend):
    err = _error(client.post("/v1/classify", content=b"{nope", headers={"content-type": "application/json"}), 422)
    assert "not valid JSON" in err["message"] and backend.calls == []


def test_limits_on_count_and_length_are_400(client, backend):
    assert "at most 8 texts" in _error(client.post("/v1/classify", json={"model": "clf", "input": ["a"] * 9}), 400)["message"]
    assert "limit is 100" in _error(client.post("/v1/classify", json={"model": "clf", "input": ["a" * 101]}), 400)["message"]
    assert backend.calls == []


def test_unknown_model_is_404_and_wrong_task_is_400(client):
    assert _error(client.post("/v1/classify", json={"model": "nope", "input": "x"}), 404)["code"] == "model_not_found"
    assert "feature-extraction" in _error(client.post("/v1/classify", json={"model": "emb", "input": "x"}), 400)["message"]


def test_backend_down_gives_503_with_retry_after_and_not_ready(client, backend):
    backend.up = False
    client.portal.call(client.app.state.gateway.registry.refresh)
    r = client.post("/v1/classify", json={"model": "clf", "input": "x"})
    _error(r, 503)
    assert int(r.headers["Retry-After"]) >= 1
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["backends"] == {"triton@fake": "down"}
    assert client.get("/healthz").status_code == 200


def test_backend_unavailable_during_a_request_is_503(client, backend):
    backend.fail_with = BackendUnavailable("queue full")
    assert _error(client.post("/v1/classify", json={"model": "clf", "input": "x"}), 503)["code"] == "backend_unavailable"


def test_unexpected_backend_errors_are_500_without_internals(client, backend):
    backend.fail_with = RuntimeError("secret path /work/main/x.py line 3")
    err = _error(client.post("/v1/classify", json={"model": "clf", "input": "x"}), 500)
    assert "secret" not in err["message"]


def test_ready_and_models(client):
    assert client.get("/readyz").json()["status"] == "ready"
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert {m["id"]: m["task"] for m in models["data"]} == {"clf": "text-classification", "emb": "feature-extraction",
                                                                "ner": "token-classification", "vit": "image-classification"}


def test_unknown_route_is_an_openai_shaped_404(client):
    _error(client.get("/v2/repository/index"), 404)


def test_metrics_have_latency_per_route_and_model(client):
    client.post("/v1/classify", json={"model": "clf", "input": "good"})
    client.post("/v1/classify", json={"model": "unknown-model-name", "input": "x"})
    text = client.get("/metrics").text
    assert 'rtxserve_request_duration_seconds_count{model="clf",route="/v1/classify",status="200"}' in text
    # unknown model names are not used as label values (unbounded cardinality)
    assert "unknown-model-name" not in text


def test_what_start_up_made_is_kept_out_of_the_collectors_reach(backend):
    """Once the app has started, the objects start-up made are frozen (gc.freeze): a full collection while streams run
    walks only what requests made since, not every module, route and setting of the worker. Stopped, it gives them
    back to the collector."""
    import gc

    from fastapi.testclient import TestClient

    from serve.gateway.app import create_app
    from serve.gateway.settings import GatewaySettings

    gc.unfreeze()
    app = create_app(GatewaySettings(health_interval_s=60), [backend])
    assert gc.get_freeze_count() == 0
    try:
        with TestClient(app):
            assert gc.get_freeze_count() > 10_000
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()

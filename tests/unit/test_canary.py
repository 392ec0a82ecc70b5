"""Deep readiness: a model takes traffic only after it answered one real request of its task."""

import time

import pytest
from fastapi.testclient import TestClient

from serve.gateway import canaries
from serve.gateway.app import create_app
from serve.gateway.exceptions import BackendError, BackendTimeout
from serve.gateway.image_generation.serving import canary_request
from serve.gateway.inputs.images import CANARY_IMAGE
from serve.gateway.settings import GatewaySettings

from .fakes import FakeTriton, error_of

CANARIES = dict(canaries.CANARIES)


@pytest.fixture(autouse=True)
def no_canaries(monkeypatch):  # this module is about them: keep them
    monkeypatch.setattr(canaries, "CANARIES", CANARIES)


def test_each_model_is_asked_with_its_own_task():
    backend = FakeTriton()
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [backend])) as client:
        assert client.get("/readyz").status_code == 200
    assert sorted(map(repr, backend.calls)) == sorted(map(repr, [["ok"], ["ok"], ["ok"], [CANARY_IMAGE]]))


def test_a_model_that_loads_but_cannot_infer_is_not_ready_until_it_can():
    backend = FakeTriton()
    backend.fail_with = BackendError("broken model")
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [backend]), raise_server_exceptions=False) as client:
        assert client.get("/readyz").status_code == 503
        assert "not ready" in error_of(client.post("/v1/classify", json={"model": "clf", "input": "x"}), 503)["message"]
        backend.fail_with = None
        client.portal.call(client.app.state.gateway.registry.refresh)
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/classify", json={"model": "clf", "input": "x"}).status_code == 200


def _wait_for(client, status: int, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.get("/readyz").status_code == status:
            return True
        time.sleep(0.02)
    return False


def test_a_ready_model_that_stops_answering_is_taken_out_and_back_in():
    """R11: a server that still calls the model ready (a dead Triton stub) does not fool the gateway: a model
    quiet for a health interval answers a canary at the next refresh, and one that fails is not ready until it
    answers again. (Refreshed here by hand, each a health interval's check, rather than waited for.)"""
    backend = FakeTriton()
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [backend]), raise_server_exceptions=False) as client:
        refresh = lambda: client.portal.call(client.app.state.gateway.registry.refresh)  # noqa: E731
        assert client.get("/readyz").status_code == 200
        backend.fail_with = BackendTimeout("busy")  # slow or overloaded is not broken: it stays in
        refresh()
        assert ["ok"] in backend.failed  # its canary was sent, and timed out
        assert client.get("/readyz").status_code == 200
        backend.fail_with = BackendError("Stub process 'clf_tokenizer_0_0' is not healthy")
        backend.failed.clear()
        refresh()
        assert ["ok"] in backend.failed and client.get("/readyz").status_code == 503
        assert "not ready" in error_of(client.post("/v1/classify", json={"model": "clf", "input": "x"}), 503)["message"]
        backend.fail_with = None
        refresh()
        assert client.get("/readyz").status_code == 200


def test_a_model_that_is_answering_is_not_probed():
    backend = FakeTriton(models=[m for m in FakeTriton().models if m.name == "clf"])
    with TestClient(create_app(GatewaySettings(health_interval_s=0.2), [backend])) as client:
        assert _wait_for(client, 200)
        backend.calls.clear()
        registry = client.app.state.gateway.registry
        checked = registry.last_refresh
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # traffic more often than the interval
            assert client.post("/v1/classify", json={"model": "clf", "input": "traffic"}).status_code == 200
            time.sleep(0.05)
        assert registry.last_refresh > checked  # the health loop ran meanwhile
    assert backend.calls and ["ok"] not in backend.calls  # and asked nothing


def test_an_image_models_canary_is_the_shape_its_entry_warmed_at_load():
    """A compiled UNet is warmed at load on one image at the entry's default size and guidance (a CFG batch of
    two); a canary of any other shape would compile again, past its deadline, on a machine with a cold cache."""
    import json

    from serve.gateway.backends.base import ModelInfo

    model = ModelInfo(name="sd", task="text-to-image", backend="triton", ready=True,
                      extra={"defaults": json.dumps({"steps": 30, "guidance": 5.0, "size": 512})})
    asked = canary_request(model)
    assert (asked["width"], asked["height"], asked["guidance"], asked["n"], asked["steps"]) == (512, 512, 5.0, 1, 1)

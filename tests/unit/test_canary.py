"""Deep readiness: a model takes traffic only after it answered one real request of its task."""

import pytest
from fastapi.testclient import TestClient

import serve.gateway.state as state_module
from serve.gateway.exceptions import BackendError
from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import FakeTriton, error_of

CANARIES = dict(state_module._CANARIES)


@pytest.fixture(autouse=True)
def no_canaries(monkeypatch):  # this module is about them: keep them
    monkeypatch.setattr(state_module, "_CANARIES", CANARIES)


def test_each_model_is_asked_once_with_its_own_task():
    backend = FakeTriton()
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [backend])) as client:
        assert client.get("/readyz").status_code == 200
        client.portal.call(client.app.state.gateway.refresh)  # not asked again while it stays up
    assert sorted(map(repr, backend.calls)) == sorted(map(repr, [["ok"], ["ok"], ["ok"], [state_module._png_1x1()]]))


def test_a_model_that_loads_but_cannot_infer_is_not_ready_until_it_can():
    backend = FakeTriton()
    backend.fail_with = BackendError("broken model")
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [backend]), raise_server_exceptions=False) as client:
        assert client.get("/readyz").status_code == 503
        assert "not ready" in error_of(client.post("/v1/classify", json={"model": "clf", "input": "x"}), 503)["message"]
        backend.fail_with = None
        client.portal.call(client.app.state.gateway.refresh)
        assert client.get("/readyz").status_code == 200
        assert client.post("/v1/classify", json={"model": "clf", "input": "x"}).status_code == 200

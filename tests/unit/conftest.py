"""In-process gateway fixtures: a fake Triton backend and a TestClient on the app (modules may
override `backend`)."""

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import FakeTriton


@pytest.fixture(autouse=True)
def no_canaries(monkeypatch):
    """The start-up canaries (one real request per model) would show in every fake's call log; only
    test_canary.py, which is about them, keeps them."""
    monkeypatch.setattr("serve.gateway.state._CANARIES", {})


@pytest.fixture
def backend():
    return FakeTriton()


@pytest.fixture
def client(backend):
    settings = GatewaySettings(max_inputs=8, max_input_chars=100, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c

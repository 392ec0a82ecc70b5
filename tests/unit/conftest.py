"""In-process gateway fixtures: a fake Triton backend and a TestClient on the app (modules may
override `backend`)."""

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.settings import GatewaySettings

from .fakes import FakeTriton


@pytest.fixture
def backend():
    return FakeTriton()


@pytest.fixture
def client(backend):
    settings = GatewaySettings(max_inputs=8, max_input_chars=100, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c

"""In-process gateway fixtures: a fake Triton backend and a TestClient on the app (modules may
override `backend`). The unit tier starts no process and opens no network socket: a test that needs either is
an integration test, and one that tries fails saying so."""

import socket
import subprocess

import matplotlib.font_manager  # noqa: F401  (its font cache is built once per machine with fc-list, a process)
import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import FakeTriton


@pytest.fixture(autouse=True)
def in_process_only(monkeypatch):
    def refuse(what):
        def refused(*args, **kwargs):
            raise AssertionError(f"a unit test {what}: it belongs in tests/integration (the unit tier stays in process)")
        return refused

    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse(f"called socket.{name}"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("started a process"))
    # the commit a report records comes from `git rev-parse` (a process): a fixed one here
    monkeypatch.setattr("loadtest.report.pages._git_commit", lambda: "0000000")


@pytest.fixture(autouse=True)
def no_canaries(monkeypatch):
    """The start-up canaries (one real request per model) would show in every fake's call log; only
    test_canary.py, which is about them, keeps them."""
    monkeypatch.setattr("serve.gateway.canaries.CANARIES", {})


@pytest.fixture
def backend():
    return FakeTriton()


@pytest.fixture
def client(backend):
    settings = GatewaySettings(max_inputs=8, max_input_chars=100, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c

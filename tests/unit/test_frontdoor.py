"""What every request passes first: body and header caps, JSON parsing, request ids, /health."""

import json

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import error_of


@pytest.fixture
def small(backend):
    settings = GatewaySettings(max_body_bytes=4096, max_header_bytes=2048, health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("raw, reason", [
    (rb'{"model": "clf", "input": "a\ud800b"}', "surrogate"),  # a lone surrogate: not text
    (b'{"model": "clf", "input": "abc"', "unexpected end"),
    (b"[" * 5000 + b"]" * 5000, "depth limit"),  # deep JSON: no RecursionError, no 500
])
def test_bodies_that_are_not_json_text_are_422_saying_why(client, backend, raw, reason):
    r = client.post("/v1/classify", content=raw, headers={"content-type": "application/json"})
    assert reason in error_of(r, 422)["message"]
    assert backend.calls == []


def test_a_nul_character_is_text_like_any_other(client, backend):
    assert client.post("/v1/classify", json={"model": "clf", "input": "a\u0000b"}).status_code == 200
    assert backend.calls == [["a\u0000b"]]


def test_wrong_content_type_is_422(client, backend):
    r = client.post("/v1/classify", content=b"model=clf&input=x", headers={"content-type": "application/x-www-form-urlencoded"})
    error_of(r, 422)
    assert backend.calls == []


def test_a_declared_oversized_body_is_413_without_being_read(small, backend):
    r = small.post("/v1/classify", content=b"x" * 5000, headers={"content-type": "application/json"})
    assert "limit of 4096 bytes" in error_of(r, 413)["message"]
    assert backend.calls == []


def test_a_chunked_oversized_body_is_413(small, backend):
    def chunks():  # no Content-Length: httpx sends it chunked
        yield b'{"model": "clf", "input": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = small.post("/v1/classify", content=chunks(), headers={"content-type": "application/json"})
    error_of(r, 413)
    assert backend.calls == []


def test_oversized_headers_are_431(small):
    r = small.get("/v1/models", headers={"x-big": "y" * 3000})
    assert "headers" in error_of(r, 431)["message"]


def test_request_ids_are_echoed_or_made(client):
    given = client.get("/healthz", headers={"x-request-id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = client.post("/v1/classify", json={"model": "nope", "input": "x"})
    assert len(made.headers["x-request-id"]) == 32 and made.status_code == 404
    odd = client.get("/healthz", headers={"x-request-id": "bad id\twith spaces"})
    assert odd.headers["x-request-id"] != "bad id\twith spaces"


def test_health_answers_like_vllm(client):
    assert client.get("/health").status_code == 200 and client.get("/healthz").json() == {"status": "ok"}


def test_refusals_at_the_door_are_counted(small):
    small.get("/v1/models", headers={"x-big": "y" * 3000})
    metrics = small.get("/metrics").text
    assert 'rtxserve_requests_total{model="",route="unmatched",status="431"}' in metrics
    assert json.loads(small.get("/v1/models").text)["object"] == "list"

"""Per-key quotas: requests and tokens per minute through `limits`, 429 + Retry-After, and a counter that
stays exact when several processes (the gateway's workers) share it."""

import asyncio
import multiprocessing
import time

import pytest
from fastapi.testclient import TestClient
from limits.aio.storage import Storage
from limits.storage import storage_from_string

from serve.gateway.access.quotas import SQLiteStorage  # noqa: F401 - registers the async+sqlite scheme
from serve.gateway.app import create_app
from serve.gateway.metrics import QUOTA_STORAGE_ERRORS
from serve.gateway.settings import GatewaySettings

from .fakes import error_of
from .test_auth import bearer, make_key
from .test_generate import FakeVLLM


@pytest.fixture
def keys(tmp_path, capsys):
    path = tmp_path / "keys.json"
    secrets = {"slow": make_key(path, capsys, "--name", "slow", "--rpm", "3"),
               "thrifty": make_key(path, capsys, "--name", "thrifty", "--tpm", "10"),
               "free": make_key(path, capsys, "--name", "free")}
    return path, secrets


def client_for(backend, keys, storage=""):
    settings = GatewaySettings(keys_file=keys[0], rate_limit_storage=storage, health_interval_s=60)
    return TestClient(create_app(settings, [backend]), raise_server_exceptions=False)


@pytest.mark.parametrize("storage", ["", "sqlite"])
def test_requests_over_the_minute_quota_are_429_with_retry_after_and_others_are_untouched(backend, keys, tmp_path, storage):
    uri = f"async+sqlite://{tmp_path}/q.sqlite" if storage else ""
    with client_for(backend, keys, uri) as client:
        body = {"model": "clf", "input": "good"}
        codes = [client.post("/v1/classify", json=body, headers=bearer(keys[1]["slow"])).status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        refused = client.post("/v1/classify", json=body, headers=bearer(keys[1]["slow"]))
        assert error_of(refused, 429)["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert all(client.post("/v1/classify", json=body, headers=bearer(keys[1]["free"])).status_code == 200
                   for _ in range(5))


def test_tokens_are_charged_from_usage_and_the_spent_key_waits(keys):
    vllm = FakeVLLM()  # every answer uses 8 tokens
    with client_for(vllm, keys) as client:
        chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}
        auth = bearer(keys[1]["thrifty"])
        assert client.post("/v1/chat/completions", json=chat, headers=auth).status_code == 200  # 8 of 10
        assert client.post("/v1/chat/completions", json=chat, headers=auth).status_code == 200  # admitted; 16 now
        assert error_of(client.post("/v1/chat/completions", json=chat, headers=auth), 429)["message"].startswith(
            "this API key has used its 10 tokens per minute")
        assert len(vllm.bodies) == 2


def _hammer(uri: str, n: int) -> None:
    storage = storage_from_string(uri)

    async def run():
        for _ in range(n):
            await storage.incr("k", 60)

    asyncio.run(run())


def test_the_sqlite_counter_is_exact_across_processes(tmp_path):
    uri = f"async+sqlite://{tmp_path}/q.sqlite"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_hammer, args=(uri, 200)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    assert asyncio.run(storage_from_string(uri).get("k")) == 600


class BrokenStorage(Storage):
    """A quota storage that cannot be reached (Redis restarting), as `limits` sees one."""

    STORAGE_SCHEME = ["async+broken"]

    @property
    def base_exceptions(self):
        return ConnectionError

    async def incr(self, key, expiry, amount=1):
        raise ConnectionError("Connect call failed ('127.0.0.1', 6379)")

    get = get_expiry = incr

    async def check(self):
        return False

    async def reset(self):
        return None

    async def clear(self, key):
        return None


@pytest.mark.parametrize("unavailable, status", [("open", 200), ("closed", 503)])
def test_an_unreachable_quota_storage_admits_uncounted_or_refuses_as_the_settings_say(backend, keys, unavailable,
                                                                                      status):
    settings = GatewaySettings(keys_file=keys[0], rate_limit_storage="async+broken://", health_interval_s=60,
                               rate_limit_unavailable=unavailable)
    before = QUOTA_STORAGE_ERRORS._value.get()
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as client:
        answers = [client.post("/v1/classify", json={"model": "clf", "input": "good"}, headers=bearer(keys[1]["slow"]))
                   for _ in range(5)]  # over its 3 per minute: nothing can count them
    assert [a.status_code for a in answers] == [status] * 5
    if status == 503:
        assert error_of(answers[0], 503)["code"] == "quota_storage_unavailable" and answers[0].headers["retry-after"]
    assert QUOTA_STORAGE_ERRORS._value.get() - before == 5


def test_a_key_found_over_its_quota_is_refused_before_its_body_is_read_until_its_window_resets(backend, keys):
    """R14: once refused, the key's next requests are answered from memory before any parsing (a body that is not
    even JSON gets the 429, not a 422) and without the quota storage; the others and the window's reset are untouched."""
    with client_for(backend, keys) as client:
        quotas = client.app.state.gateway.access.quotas
        slow = bearer(keys[1]["slow"])
        for _ in range(4):
            client.post("/v1/classify", json={"model": "clf", "input": "good"}, headers=slow)
        assert len(backend.calls) == 3 and len(quotas.spent) == 1

        async def untouchable(*args, **kwargs):
            raise AssertionError("the quota storage was asked about a key known to be over its quota")

        counted = quotas.limiter.hit
        quotas.limiter.hit = quotas.limiter.test = untouchable
        refused = client.post("/v1/classify", content=b"{not json", headers={**slow, "content-type": "application/json"})
        assert error_of(refused, 429)["message"] == "this API key has used its 3 requests per minute; retry later"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        asked = []

        async def counting(*args, **kwargs):
            asked.append(args)
            return await counted(*args, **kwargs)

        quotas.limiter.hit = counting
        assert client.post("/v1/classify", json={"model": "clf", "input": "good"},
                           headers=bearer(keys[1]["free"])).status_code == 200
        assert asked == []  # free has no quota to count
        ((key, (_, message)),) = quotas.spent.items()
        quotas.spent[key] = (time.time() - 1, message)  # the remembered window has passed
        error_of(client.post("/v1/classify", json={"model": "clf", "input": "good"}, headers=slow), 429)
        assert len(asked) == 1  # the storage decides again (the real minute is not over: refused, remembered anew)

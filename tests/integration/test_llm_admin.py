"""The gateway's admin route for adapters (`/admin/adapters`, admin keys only), on the session's real vLLM: an adapter
loaded on the running engine answers as the same weights under their started name do, is listed at once, and is
unloaded again; refusals are one-line 4xx with nothing loaded."""

import contextlib
import io

import httpx
import pytest

from serve.gateway.access.keys_cli import main as keys_main
from serve.stack import start_gateway

GREEDY = {"messages": [{"role": "user", "content": "the model answers"}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(llm_servers, tmp_path_factory):
    """(gateway URL, {key name: Authorization header}): a gateway with keys on the session's vLLM."""
    work = tmp_path_factory.mktemp("admin")
    keys, headers = work / "keys.json", {}
    for args in (["--name", "ops", "--admin"], ["--name", "app", "--models", "*"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert keys_main(["--keys", str(keys), "create", *args]) == 0
        headers[args[1]] = {"Authorization": f"Bearer {out.getvalue().strip()}"}
    gateway, url = start_gateway("", work, vllm_url=llm_servers[1], extra_env={"RTXSERVE_KEYS_FILE": str(keys)})
    yield url, headers
    gateway.stop()


def _models(url: str, headers: dict) -> set[str]:
    return {m["id"] for m in httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]}


def _chat(url: str, headers: dict, model: str) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, **GREEDY}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_an_admin_key_loads_and_unloads_an_adapter_on_the_running_engine(keyed, llm_fixtures):
    url, keys = keyed
    ops = keys["ops"]
    body = {"name": "adapter-c", "path": str(llm_fixtures / "adapter-b"), "base": "tiny-llama"}
    r = httpx.post(f"{url}/admin/adapters", json=body, headers=ops, timeout=150)
    assert r.status_code == 200 and r.json() == {"name": "adapter-c", "base": "tiny-llama", "replicas": 1}, r.text
    try:
        assert "adapter-c" in _models(url, keys["app"])  # listed when the load answers
        assert _chat(url, keys["app"], "adapter-c") == _chat(url, keys["app"], "adapter-b")  # the same weights
        again = httpx.post(f"{url}/admin/adapters", json=body, headers=ops, timeout=30)
        assert again.status_code == 400 and "adapter-c is already served" in again.json()["error"]["message"]
    finally:
        r = httpx.delete(f"{url}/admin/adapters/adapter-c", headers=ops, timeout=60)
    assert r.status_code == 200 and r.json() == {"name": "adapter-c", "replicas": 1}, r.text
    assert "adapter-c" not in _models(url, ops)
    assert httpx.delete(f"{url}/admin/adapters/adapter-c", headers=ops, timeout=30).status_code == 404


@pytest.mark.parametrize("method, path, body, status, says", [
    ("post", "/admin/adapters", {"name": "x", "path": "/nowhere", "base": "tiny-llama"}, 400, "adapter x not loaded"),
    ("post", "/admin/adapters", {"name": "x", "path": "/nowhere", "base": "no-such-llm"}, 404, "no model 'no-such-llm'"),
    ("post", "/admin/adapters", {"name": "adapter-a", "path": "/nowhere", "base": "tiny-llama"}, 400, "already served"),
    ("post", "/admin/adapters", {"name": "../x", "path": "/p", "base": "tiny-llama"}, 422, None),
    ("delete", "/admin/adapters/tiny-llama", None, 404, "no adapter 'tiny-llama'"),  # a base is not unloaded
])
def test_bad_admin_requests_are_refused_with_nothing_loaded(keyed, method, path, body, status, says):
    url, keys = keyed
    before = _models(url, keys["ops"])
    r = httpx.request(method, f"{url}{path}", json=body, headers=keys["ops"], timeout=60)
    assert r.status_code == status, r.text
    assert says is None or says in r.json()["error"]["message"]
    assert _models(url, keys["ops"]) == before


def test_only_an_admin_key_of_a_keyed_gateway_may(keyed, llm_gateway):
    url, keys = keyed
    body = {"name": "x", "path": "/p", "base": "tiny-llama"}
    assert httpx.post(f"{url}/admin/adapters", json=body, headers=keys["app"], timeout=10).status_code == 403
    assert httpx.post(f"{url}/admin/adapters", json=body, timeout=10).status_code == 401
    open_gateway = httpx.post(f"{llm_gateway}/admin/adapters", json=body, timeout=10)  # no keys: no admin routes
    assert open_gateway.status_code == 403 and "no API keys" in open_gateway.json()["error"]["message"]

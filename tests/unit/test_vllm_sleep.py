"""The gateway's calls to vLLM's sleep API (a fake session records them): a level-2 engine is woken as vLLM needs
(weights, their reload, then the KV cache: a plain /wake_up from level 2 left uninitialised weights), and sleep waits
for what the engine runs (vLLM's default mode, abort, cut another gateway's streams); engine_control answers the
level-2 sequence on a CPU."""

import asyncio
import contextlib

import pytest
from starlette.testclient import TestClient

from serve.engine_control import app
from serve.gateway.backends.vllm import VLLMBackend


class _Answer:
    status = 200

    async def read(self):
        return b"{}"


class _Session:
    def __init__(self):
        self.calls = []

    @contextlib.asynccontextmanager
    async def _post(self, url, json=None, timeout=None):
        self.calls.append((url, json))
        yield _Answer()

    def post(self, url, json=None, timeout=None):
        return self._post(url, json, timeout)


def _calls(level: int, action: str) -> list:
    backend = VLLMBackend("http://engine:8100", 60.0, control="http://engine:8100", serves=("m",), sleep_level=level)
    backend.session = _Session()
    asyncio.run(getattr(backend, action)("m", 30.0) if action == "load" else backend.unload("m"))
    return backend.session.calls


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_waits_for_what_the_engine_runs(level):
    assert _calls(level, "unload") == [(f"http://engine:8100/sleep?level={level}&mode=wait", None)]


def test_a_level_1_engine_wakes_in_one_call_and_a_level_2_one_reloads_its_weights_between_two():
    assert _calls(1, "load") == [("http://engine:8100/wake_up", None)]
    assert _calls(2, "load") == [("http://engine:8100/wake_up?tags=weights", None),
                                 ("http://engine:8100/collective_rpc", {"method": "reload_weights"}),
                                 ("http://engine:8100/wake_up?tags=kv_cache", None)]


class _Awake:
    sleeping = False

    async def wake_up(self):
        pass

    async def sleep(self):
        pass


def test_engine_control_answers_the_level_2_sequence_and_nothing_else_it_does_not_know():
    with TestClient(app(_Awake())) as client:
        assert client.post("/wake_up?tags=weights").json() == {"is_sleeping": False}
        assert client.post("/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
        refused = client.post("/collective_rpc", json={"method": "execute_model"})
        assert refused.status_code == 400 and "reload_weights" in refused.json()["error"]["message"]
        assert client.post("/collective_rpc", content=b"not json").status_code == 400

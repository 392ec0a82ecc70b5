"""Admission by priority and fair shares: a freed slot goes to the lowest priority number waiting, and among equals
to each key in turn, so one key's flood cannot starve another's trickle (the order of the hand-overs, exactly)."""

import asyncio

import pytest

from serve.gateway.access.keys import ApiKey, hash_key
from serve.gateway.edge.admission import Gate
from serve.gateway.exceptions import Overloaded


async def _served_order(waiters: list[tuple[int, str]], limit: int = 1) -> list[str]:
    """Hold every slot, queue `waiters` (priority, key) in that order, then free one slot at a time: who got each."""
    gate = Gate(limit, max_queue=100, timeout_s=10)
    for _ in range(limit):
        await gate.acquire()
    order: list[str] = []

    async def wait(priority: int, key: str, n: int):
        await gate.acquire(priority, key)
        order.append(f"{key}{n}")

    tasks = [asyncio.create_task(wait(p, k, n)) for n, (p, k) in enumerate(waiters)]
    await asyncio.sleep(0)  # every waiter queued
    for _ in waiters:
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_an_interactive_request_goes_before_a_queued_batch_flood():
    flood = [(10, "batch")] * 5
    assert asyncio.run(_served_order([*flood, (0, "chat")]))[0] == "chat5"


def test_keys_of_one_priority_take_turns():
    waiters = [(10, "a")] * 4 + [(10, "b")]  # b's one request arrives behind a's four
    assert asyncio.run(_served_order(waiters)) == ["a0", "b4", "a1", "a2", "a3"]


def test_a_waiter_that_gave_up_is_skipped_and_its_slot_not_lost():
    async def run():
        gate = Gate(1, max_queue=10, timeout_s=0.05)
        await gate.acquire()
        with pytest.raises(Overloaded, match="queue wait timed out"):
            await gate.acquire(0, "late")
        gate.timeout_s = 10
        waiting = asyncio.create_task(gate.acquire(0, "next"))
        await asyncio.sleep(0)
        gate.release()  # to "next", not to the one that left
        await asyncio.wait_for(waiting, 1)
        gate.release()
        return gate.in_use, gate.waiting

    assert asyncio.run(run()) == (0, 0)


@pytest.mark.parametrize("given, expected", [("interactive", 0), ("batch", 10), (5, 5)])
def test_a_key_priority_is_a_name_or_a_number(given, expected):
    assert ApiKey("k", hash_key("s"), priority=given).priority == expected


def test_an_unknown_priority_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="priority 'urgent' is none of interactive, batch"):
        ApiKey("k", hash_key("s"), priority="urgent")


@pytest.mark.parametrize("limits", [{"max_concurrency": 1}, {"model_concurrency": {"clf": 1}}], ids=["gateway", "model"])
def test_through_the_gateway_a_chat_key_overtakes_a_batch_keys_queue(tmp_path, limits):
    """One slot (the gateway's, or the model's own), held; a batch key's three requests wait, then a chat key's one:
    when the slot frees, the chat key's request is the next the backend sees, then the batch key's."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from serve.gateway.access.keys import write_keys
    from serve.gateway.app import create_app
    from serve.gateway.settings import GatewaySettings

    from .fakes import GatedTriton

    write_keys(tmp_path / "keys.json", {"batch": ApiKey("batch", hash_key("rtx-batch"), priority="batch"),
                                        "chat": ApiKey("chat", hash_key("rtx-chat"))})
    backend = GatedTriton()
    settings = GatewaySettings(max_queue=10, queue_timeout_s=30, health_interval_s=60, keys_file=tmp_path / "keys.json",
                               **limits)
    with TestClient(create_app(settings, [backend])) as client, ThreadPoolExecutor(5) as pool:
        def send(secret: str, text: str):
            return client.post("/v1/classify", json={"model": "clf", "input": text},
                               headers={"Authorization": f"Bearer {secret}"}).status_code

        def until(condition):
            deadline = time.monotonic() + 10
            while not condition():
                assert time.monotonic() < deadline
                time.sleep(0.01)

        queued = lambda: sum(float(l.rsplit(" ", 1)[1]) for l in client.get("/metrics").text.splitlines()  # noqa: E731
                             if l.startswith("rtxserve_requests_queued "))
        backend.gate.clear()
        answers = [pool.submit(send, "rtx-batch", "batch 0")]
        until(lambda: backend.holding == 1)
        answers += [pool.submit(send, "rtx-batch", f"batch {n}") for n in (1, 2, 3)]
        until(lambda: queued() == 3)
        answers.append(pool.submit(send, "rtx-chat", "chat"))
        until(lambda: queued() == 4)
        backend.gate.set()
        assert [a.result() for a in answers] == [200] * 5
    texts = [c[0] for c in backend.calls]
    assert texts[:2] == ["batch 0", "chat"] and sorted(texts[2:]) == ["batch 1", "batch 2", "batch 3"]


@pytest.mark.parametrize("on, asked, sent", [(True, None, 10), (True, 20, 20), (True, 0, 10), (False, None, None)])
def test_a_generation_carries_its_keys_priority_to_a_vllm_that_schedules_by_it(tmp_path, on, asked, sent):
    from fastapi.testclient import TestClient

    from serve.gateway.access.keys import write_keys
    from serve.gateway.app import create_app
    from serve.gateway.settings import GatewaySettings

    from .test_generate import FakeVLLM

    write_keys(tmp_path / "keys.json", {"batch": ApiKey("batch", hash_key("rtx-batch"), priority="batch")})
    engine = FakeVLLM()
    settings = GatewaySettings(health_interval_s=60, keys_file=tmp_path / "keys.json", vllm_priority=on)
    with TestClient(create_app(settings, [engine])) as client:
        answer = client.post("/v1/chat/completions", headers={"Authorization": "Bearer rtx-batch"}, json={
            "model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **({"priority": asked} if asked is not None else {})})
    assert answer.status_code == 200, answer.text
    assert engine.bodies[-1].get("priority") == (asked if sent is None else sent)

"""People before a batch by default (serve/gateway/fleet/yielding.py): a batch's request beyond its floor waits while a
person's request to the same servers waits for its first token, and goes the moment it has it; the floor always goes
(no starvation); other servers' people hold nothing; a person's stream counts as answered at its first chunk."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi.testclient import TestClient

from serve.gateway.access.keys import ApiKey, hash_key, write_keys
from serve.gateway.app import create_app
from serve.gateway.backends.base import Stream, StreamChunk
from serve.gateway.fleet.dispatch import _FirstChunk
from serve.gateway.generate.serving import _Relay
from serve.gateway.fleet.yielding import PeopleFirst, _once
from serve.gateway.settings import GatewaySettings
from tests import until

from .fakes import GatedTriton


def test_the_batch_beyond_its_floor_waits_for_people_s_first_token_and_other_servers_hold_nothing():
    async def run():
        people = PeopleFirst(floor=2)
        first_token = people.person(("engine-a",))
        went = []

        async def batch(n: int, group=("engine-a",)):
            ended = await people.batch_turn(group)
            went.append(n)
            return ended

        tasks = [asyncio.create_task(batch(n)) for n in range(4)]
        elsewhere = await asyncio.wait_for(batch(9, ("engine-b",)), 1)  # nobody waits there
        await asyncio.sleep(0.01)
        held = list(went)
        first_token()
        first_token()  # once only: a second call changes nothing
        ended = await asyncio.wait_for(asyncio.gather(*tasks), 1)
        for end in [*ended, elsewhere]:
            end()
        return held, went, dict(people.people_waiting), dict(people.batch_running)

    held, went, waiting, running = asyncio.run(run())
    assert held == [0, 1, 9] and sorted(went) == [0, 1, 2, 3, 9]  # the floor went at once, the rest after the token
    assert set(waiting.values()) == {0} and set(running.values()) == {0}


def test_a_person_s_stream_has_its_first_token_at_its_first_chunk_or_when_closed_before():
    class Chunks(Stream):
        def __init__(self):
            self.closed = False

        async def __aiter__(self):
            for text in (b"a", b"b"):
                yield StreamChunk(text)

        async def aclose(self):
            self.closed = True

    async def run():
        seen, marks = [], []

        async def send(raw: bytes) -> None:
            marks.append(len(seen))

        # what relays the stream says when its first chunk came
        await _Relay(_FirstChunk(Chunks(), _once(lambda: seen.append(len(seen)))), "m", False, None).pump(send)
        closed = _FirstChunk(inner := Chunks(), lambda: seen.append("closed"))
        await closed.aclose()
        return marks, seen, inner.closed

    assert asyncio.run(run()) == ([1, 1, 1], [0, "closed"], True)  # two chunks and the end marker


def test_through_the_gateway_a_batch_key_waits_while_a_person_is_served(tmp_path):
    """A person's classify held in the backend; a batch key's three requests: its floor (one) reaches the backend
    beside the person, the two others only once the person has the answer; all answered."""
    write_keys(tmp_path / "keys.json", {"batch": ApiKey("batch", hash_key("rtx-batch"), priority="batch"),
                                        "chat": ApiKey("chat", hash_key("rtx-chat"))})
    backend = GatedTriton()
    settings = GatewaySettings(health_interval_s=60, keys_file=tmp_path / "keys.json")
    with TestClient(create_app(settings, [backend])) as client, ThreadPoolExecutor(4) as pool:
        def send(secret: str):
            return client.post("/v1/classify", json={"model": "clf", "input": "good"},
                               headers={"Authorization": f"Bearer {secret}"}).status_code

        backend.gate.clear()
        person = pool.submit(send, "rtx-chat")
        until(lambda: backend.holding == 1)
        batch = [pool.submit(send, "rtx-batch") for _ in range(3)]
        until(lambda: backend.holding == 2)
        time.sleep(0.3)
        assert backend.holding == 2  # the floor beside the person, the others at the gateway
        backend.gate.set()
        assert person.result(10) == 200 and [b.result(10) for b in batch] == [200] * 3
    assert len(backend.calls) == 4

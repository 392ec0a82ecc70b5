"""The Triton client's coalescing (serve/gateway/backends/triton.py): batches that arrive while a call is out leave
together as one call, each request keeps its own rows and its own error. Triton's gRPC stub is faked."""

import asyncio
import dataclasses

import grpc
import pytest

from serve.gateway.backends.base import ModelInfo
from serve.gateway.backends.triton import TritonBackend
from serve.gateway.exceptions import BackendUnavailable, InvalidRequest

from .fakes import FakeGrpc, request_inputs

CLASSIFIER = ModelInfo("clf", "text-classification", "triton", True, ("only",), 8)


class HeldGrpc(FakeGrpc):
    """FakeGrpc whose first call waits until `release` is set. A call holding the text "bad" is refused as Triton
    refuses an input (INVALID_ARGUMENT); with `down`, every call after the first finds Triton gone."""

    def __init__(self, down: bool = False):
        super().__init__()
        self.release = asyncio.Event()
        self.down = down
        self.calls = 0

    async def __call__(self, request, timeout):
        self.calls += 1
        _, texts = request_inputs(request)
        if self.calls == 1:
            await self.release.wait()
        elif self.down:
            self.batches.append(len(texts))
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
        if b"bad" in texts:
            self.batches.append(len(texts))
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "in ensemble 'clf', input 1 is bad")
        return await super().__call__(request, timeout)


async def _while_one_is_out(backend: TritonBackend, later: list[list[str]], model: ModelInfo = CLASSIFIER,
                            cancel: int | None = None) -> list:
    """A first request of one text is sent and held; `later`'s requests arrive meanwhile (request `cancel` is then
    cancelled, its client gone); then the first call returns. Each request's labels, or the error it got."""
    first = asyncio.create_task(backend.classify(model, ["x"], 1.0))
    await asyncio.sleep(0.01)
    tasks = [asyncio.create_task(backend.classify(model, texts, 1.0)) for texts in later]
    await asyncio.sleep(0.01)
    if cancel is not None:
        tasks[cancel].cancel()
    backend._infer.release.set()
    results = await asyncio.gather(first, *tasks, return_exceptions=True)
    return [[c.label for c in r] if isinstance(r, list) else r for r in results]


def _backend(calls: int = 1, **fake) -> TritonBackend:
    backend = TritonBackend("unused:0", coalesce_calls=calls)
    backend._infer = HeldGrpc(**fake)
    return backend


def test_batches_that_arrive_while_a_call_is_out_leave_together_each_with_its_own_rows():
    backend = _backend()
    results = asyncio.run(_while_one_is_out(backend, [["aa"], ["bbb", "c"], ["dddd"]]))
    assert backend._infer.batches == [1, 4]  # the first alone (nothing waited), the three others in one call
    assert results == [["1"], ["2"], ["3", "1"], ["4"]]


def test_a_model_whose_answers_triton_caches_gets_each_request_as_its_own_call():
    # the cache keys a call by its whole input: a coalesced mix of requests would never be seen twice
    backend = _backend()
    cached = dataclasses.replace(CLASSIFIER, response_cache=True)
    results = asyncio.run(_while_one_is_out(backend, [["aa"], ["bbb", "c"], ["dddd"]], cached))
    assert sorted(backend._infer.batches) == [1, 1, 1, 2] and results == [["1"], ["2"], ["3", "1"], ["4"]]


def test_a_coalesced_call_stays_within_max_batch_size_and_keeps_batches_whole():
    backend = _backend()
    model = ModelInfo("clf", "text-classification", "triton", True, ("only",), 3)
    results = asyncio.run(_while_one_is_out(backend, [["aa", "bb"], ["ccc", "ccc"], ["d"]], model))
    assert backend._infer.batches == [1, 2, 3]
    assert results == [["1"], ["2", "2"], ["3", "3"], ["1"]]


def test_a_refused_input_fails_only_its_own_request():
    backend = _backend()
    results = asyncio.run(_while_one_is_out(backend, [["aa"], ["bad"], ["ccc"]]))
    assert backend._infer.batches == [1, 3, 1, 1, 1]  # the coalesced call refused, then each batch alone
    assert results[0] == ["1"] and results[1] == ["2"] and results[3] == ["3"]
    assert isinstance(results[2], InvalidRequest) and "input 1 is bad" in str(results[2])


def test_triton_down_fails_every_request_of_the_call_once():
    backend = _backend(down=True)
    results = asyncio.run(_while_one_is_out(backend, [["aa"], ["bbb"]]))
    assert backend._infer.batches == [1, 2]
    assert results[0] == ["1"] and all(isinstance(r, BackendUnavailable) for r in results[1:])


def test_a_request_cancelled_while_it_waits_is_not_sent():
    backend = _backend()
    results = asyncio.run(_while_one_is_out(backend, [["aa"], ["bbb"]], cancel=0))
    assert backend._infer.batches == [1, 1]  # "aa" never left
    assert isinstance(results[1], asyncio.CancelledError) and results[2] == ["3"]


def test_a_free_call_is_taken_at_once_and_zero_turns_coalescing_off():
    for calls in (2, 0):
        backend = _backend(calls)
        results = asyncio.run(_while_one_is_out(backend, [["aa"], ["bbb"], ["c"]]))
        # 2: the second call is free whenever one arrives (the fake answers at once); 0: every request on its own
        assert backend._infer.batches == [1, 1, 1, 1], calls
        assert results == [["1"], ["2"], ["3"], ["1"]]


def test_a_model_that_takes_one_row_per_call_is_not_held_back():
    backend = _backend()
    model = ModelInfo("clf", "text-classification", "triton", True, ("only",), 1)
    assert asyncio.run(_while_one_is_out(backend, [["aa"], ["bbb"]], model)) == [["1"], ["2"], ["3"]]
    assert backend._infer.batches == [1, 1, 1]


def test_calls_with_other_parameters_are_not_merged():
    backend = _backend()
    model = ModelInfo("ner", "token-classification", "triton", True, (), 8)

    async def tagging():
        held = asyncio.create_task(backend.tag(model, ["Ada"], "simple", 1.0))
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(backend.tag(model, ["Ada Lovelace"], how, 1.0)) for how in ("first", "simple", "simple")]
        await asyncio.sleep(0.01)
        backend._infer.release.set()
        await asyncio.gather(held, *later)

    asyncio.run(tagging())
    # "first" has a line of its own, free: sent at once; the two "simple" waited for the held one, and left together
    assert backend._infer.batches == [1, 1, 2]
    assert [p["aggregation"] for p in backend._infer.parameters] == ["first", "simple", "simple"]


def test_the_gateway_setting_reaches_the_triton_client(monkeypatch):
    from serve.gateway.backends.factory import make_backend
    from serve.gateway.settings import GatewaySettings

    monkeypatch.setenv("RTXSERVE_COALESCE_CALLS", "0")
    assert make_backend("triton", "unused:0", GatewaySettings()).coalesce_calls == 0
    with pytest.raises(ValueError):
        GatewaySettings(coalesce_calls=-1)


def test_the_deadline_counts_from_arrival_so_waiting_behind_a_hung_call_is_part_of_it():
    from serve.gateway.exceptions import BackendTimeout

    backend = _backend()

    async def behind_a_hung_call():
        first = asyncio.create_task(backend.classify(CLASSIFIER, ["x"], 5.0))  # held: Triton hangs
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(BackendTimeout, match="deadline"):
            await backend.classify(CLASSIFIER, ["aa"], 0.2)
        waited = loop.time() - start
        backend._infer.release.set()
        await first
        return waited

    assert 0.19 <= asyncio.run(behind_a_hung_call()) < 1.0  # its 0.2 s, not the hung call's 5 s
    assert backend._infer.batches == [1]  # the request that timed out while it waited was never sent

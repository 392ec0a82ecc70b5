"""OpenAI generation endpoints in-process with a fake vLLM backend: bounds, routing, stream relay."""

import json

import pytest
from fastapi.testclient import TestClient

from serve.gateway.backends.base import Backend, ModelInfo
from serve.gateway.backends.vllm import SSEStream, raise_for_status
from serve.gateway.exceptions import InvalidRequest
from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import error_of


def FakeStream(lines, reads: int | str = 1, connection: list | None = None):
    """vLLM's stream parser over a canned SSE body, arriving in `reads` pieces of about equal size, or an event a read
    (`reads="events"`, as vLLM's tokens mostly come); what becomes of its connection ("closed" or "released") is
    appended to `connection`."""
    body = "\n\n".join(lines).encode() + b"\n\n"
    pieces = [line.encode() + b"\n\n" for line in lines] if reads == "events" else \
        [body[i:i + -(-len(body) // reads)] for i in range(0, len(body), -(-len(body) // reads))]
    connection = connection if connection is not None else []

    async def arriving():
        for piece in pieces:
            yield piece

    return SSEStream(arriving(), lambda: connection.append("closed"), "llm", release=lambda: connection.append("released"))


class FakeVLLM(Backend):
    kind = "vllm"

    def __init__(self):
        self.bodies, self.stream = [], None

    async def discover(self):
        return [ModelInfo("llm", "text-generation", "vllm", True), ModelInfo("llm-lora", "text-generation", "vllm", True)]

    async def generate(self, path, body, model):
        self.bodies.append(body)
        return {"object": "chat.completion", "model": model, "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}

    async def open_stream(self, path, body, model):
        self.bodies.append(body)
        return self.stream


def _chunk(text="", usage=None):
    """An event as vLLM writes it (pydantic's compact JSON, the id first, usage only where set)."""
    choices = [] if usage else [{"index": 0, "delta": {"content": text}}]
    return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices,
                                  **({"usage": usage} if usage else {})}, separators=(",", ":"))


@pytest.fixture
def backend():
    return FakeVLLM()


@pytest.fixture
def client(backend):
    with TestClient(create_app(GatewaySettings(max_tokens=100, max_n=2, max_messages=8, max_prompt_chars=500, max_tools=3,
                                                   max_tools_bytes=1000, health_interval_s=60), [backend])) as c:
        yield c


CHAT = {"model": "llm-lora", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_routes_to_the_adapter_and_counts_usage(client, backend):
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10})
    assert r.status_code == 200 and backend.bodies[-1]["model"] == "llm-lora"
    metrics = client.get("/metrics").text
    assert 'rtxserve_tokens_total{kind="completion",model="llm-lora"} 5.0' in metrics


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_completion_tokens": 101}, "max_completion_tokens"),
        ({"n": 3}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}] * 9}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 501}]}]}, "messages"),
        ({"tools": [TOOL] * 4}, "tools"),
        ({"tools": [{**TOOL, "description": "d" * 2000}]}, "tools"),
    ],
)
def test_what_costs_money_or_memory_is_bounded_before_vllm(client, backend, extra, param):
    r = client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert error_of(r, 400)["param"] == param
    assert backend.bodies == []


@pytest.mark.parametrize("body, param", [({"messages": []}, "messages"), ({"model": ""}, "model"),
                                         ({"max_tokens": "many"}, "max_tokens")])
def test_malformed_bodies_are_422(client, backend, body, param):
    assert error_of(client.post("/v1/chat/completions", json={**CHAT, **body}), 422)["param"] == param
    assert backend.bodies == []


# What OpenAI clients, LangChain agents, `vllm bench serve` and guidellm send: all of it reaches vLLM as sent.
RELAYED = {
    "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    "logit_bias": {"15": -100}, "store": False, "metadata": {"team": "a"}, "top_k": 5, "min_p": 0.1,
    "repetition_penalty": 1.1, "ignore_eos": True, "temperature": 3.5, "some_field_of_next_year": {"x": [1]},
    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                 {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                       "function": {"name": "get_weather", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
}


def test_every_other_field_is_relayed_as_sent(client, backend):
    r = client.post("/v1/chat/completions", json={**CHAT, **RELAYED, "max_tokens": 10})
    assert r.status_code == 200, r.text
    assert backend.bodies[-1] == {**CHAT, **RELAYED, "max_tokens": 10}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_names_no_length_gets_the_gateways_bound(client, backend, stream):
    """Left out, vLLM would generate up to the rest of the context (chat) past the gateway's max_tokens (100 here);
    a completion keeps OpenAI's and vLLM's default of 16."""
    backend.stream = FakeStream([_chunk("a"), "data: [DONE]"])
    assert client.post("/v1/chat/completions", json={**CHAT, "ignore_eos": True, "stream": stream}).status_code == 200
    assert backend.bodies[-1]["max_completion_tokens"] == 100 and "max_tokens" not in backend.bodies[-1]
    for named in ({"max_tokens": 7}, {"max_completion_tokens": 7}):
        assert client.post("/v1/chat/completions", json={**CHAT, **named}).status_code == 200
        assert {k: v for k, v in backend.bodies[-1].items() if k.startswith("max_")} == named
    assert client.post("/v1/completions", json={"model": "llm", "prompt": "hi"}).status_code == 200
    assert backend.bodies[-1]["max_tokens"] == 16


def test_completions_relay_extras_and_bound_logprobs_and_prompt_size(client, backend):
    sent = {"model": "llm", "prompt": [[1, 2, 3]], "ignore_eos": True, "max_tokens": 4, "logprobs": 5}
    assert client.post("/v1/completions", json=sent).status_code == 200 and backend.bodies[-1] == sent
    assert error_of(client.post("/v1/completions", json={**sent, "logprobs": 21}), 400)["param"] == "logprobs"
    assert error_of(client.post("/v1/completions", json={**sent, "prompt": "x" * 501}), 400)["param"] == "prompt"
    assert len(backend.bodies) == 1


def test_stream_options_are_kept_and_usage_is_asked_for(client, backend):
    backend.stream = FakeStream(["data: [DONE]"])
    options = {"include_usage": False, "continuous_usage_stats": True}
    client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": options})
    assert backend.bodies[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_vllms_own_400_reaches_the_client_in_our_error_shape():
    content = json.dumps({"object": "error", "message": "temperature must be in [0, 2]", "type": "BadRequestError",
                          "param": "temperature", "code": 400}).encode()
    with pytest.raises(InvalidRequest, match=r"temperature must be in \[0, 2\]") as info:
        raise_for_status(400, content, "llm")
    assert info.value.param == "temperature"


def test_stream_is_relayed_and_usage_chunk_only_sent_when_asked(client, backend):
    backend.stream = FakeStream([_chunk("Hel"), _chunk("lo"), _chunk(usage={"prompt_tokens": 2, "completion_tokens": 2}), "data: [DONE]"])
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert len(events) == 3 and events[-1] == "data: [DONE]"  # usage chunk dropped: not asked for
    assert backend.bodies[-1]["stream_options"] == {"include_usage": True}  # but always asked of vLLM
    assert backend.stream.closed


@pytest.mark.parametrize("lines, fate", [([_chunk("Hel"), "data: [DONE]"], "released"),
                                         ([_chunk("Hel")], "closed"), ([_chunk("Hel"), "data: {not json"], "closed")])
def test_a_finished_streams_connection_goes_back_to_the_pool_a_cut_one_is_closed(client, backend, lines, fate):
    """Closing vLLM's connection is what aborts a generation; after [DONE] it is released instead (closing finished
    streams' connections made vLLM hold back the whole of later answers)."""
    connection = []
    backend.stream = FakeStream(lines, connection=connection)
    client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert connection == [fate]


@pytest.mark.parametrize("reads", [1, 3, 7, 1000, "events"])
def test_events_are_relayed_whole_however_the_bytes_arrive(client, backend, reads):
    """Events split across reads, several in one read, CR LF line ends, a comment and the usage chunk among them:
    what the client gets is every token event as vLLM sent it, the usage chunk when asked, then [DONE]."""
    tokens = [_chunk(t) for t in ("Hel", "lo", " wor", "ld")]
    usage = _chunk(usage={"prompt_tokens": 2, "completion_tokens": 4})
    body = [tokens[0], tokens[1], ": keep-alive", tokens[2].replace("data: ", "data:") + "\r\n", tokens[3], usage,
            "data: [DONE]"]
    backend.stream = FakeStream(body, reads=reads)
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = [e for e in r.text.split("\n\n") if e]
    assert events == [*tokens, usage, "data: [DONE]"]
    assert r.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("reads", [1, 3, 7, 1000, "events"])
def test_pumping_a_stream_hands_on_what_iterating_it_gives(reads):
    """The relay pumps a stream (one frame a read: a read that is one token's event handed on unparsed); iterating it
    gives the same bytes and the same usage, however the bytes arrive."""
    import asyncio

    usage = {"prompt_tokens": 2, "completion_tokens": 3}
    body = [_chunk("a"), _chunk("b"), ": keep-alive", _chunk("c") + "\r\n", _chunk(usage=usage), "data: [DONE]"]

    async def both():
        iterated = [(chunk.raw, chunk.usage) async for chunk in FakeStream(body, reads=reads)]
        pumped = []

        async def deliver(raw, usage):
            pumped.append((raw, usage))

        await FakeStream(body, reads=reads).pump(deliver)
        return iterated, pumped

    iterated, pumped = asyncio.run(both())
    assert b"".join(raw for raw, _ in pumped) == b"".join(raw for raw, _ in iterated)
    assert [u for _, u in pumped if u] == [u for _, u in iterated if u] == [usage]
    assert b"".join(raw for raw, _ in pumped).count(b"data: {") == 4 and b"[DONE]" not in pumped[-1][0]


def test_text_with_unicode_line_separators_is_relayed_whole(client, backend):
    """U+2028, U+2029 and NEL end lines for str.splitlines (and httpx's aiter_lines), not for SSE; vLLM's JSON
    carries them unescaped when a model writes them."""
    text = "a\u2028b\u2029c\x85d"
    backend.stream = FakeStream([_chunk(text).replace("\\u2028", "\u2028").replace("\\u2029", "\u2029")
                                 .replace("\\u0085", "\x85"), "data: [DONE]"])
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 2, events
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("tail", [[], ["data: {not json"], ['data: {"error": {"message": "engine dead"}}', "data: [DONE]"]])
def test_a_stream_cut_short_ends_with_an_error_event_not_done(client, backend, tail):
    backend.stream = FakeStream([_chunk("Hel"), *tail])  # no [DONE], garbage, or vLLM's own error event
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert "[DONE]" not in r.text
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "backend_stream_error" and "partial" in error["message"]


def test_classify_models_are_not_generation_models(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "unknown"})
    assert r.status_code == 404


def test_a_stream_holds_its_model_slot_until_it_ends(backend):
    """model_concurrency counts a stream until it is closed: the slot comes back after each one, never leaks."""
    settings = GatewaySettings(model_concurrency={"llm-lora": 1}, max_queue=0, health_interval_s=60)
    with TestClient(create_app(settings, [backend])) as client:
        for _ in range(3):
            backend.stream = FakeStream([_chunk("Hel"), "data: [DONE]"])
            assert client.post("/v1/chat/completions", json={**CHAT, "stream": True}).status_code == 200
        state = client.app.state.gateway
        assert state.dispatch.gates["llm-lora"].in_use == 0 and backend.stream.closed


def test_every_answer_carries_the_gateways_own_time_without_the_backends(backend):
    """x-rtxserve-overhead-ms: the time the gateway held the request less its backend calls. The backend here
    takes 300 ms, so a figure that counted it would not fit in what the client waited less those; refusals carry it
    too, and the histogram counts each answer under its route."""
    import asyncio

    slow = backend.generate

    async def generate(path, body, model):
        await asyncio.sleep(0.3)
        return await slow(path, body, model)

    from prometheus_client import REGISTRY

    counted = lambda: REGISTRY.get_sample_value("rtxserve_gateway_overhead_seconds_count",  # noqa: E731
                                                {"route": "/v1/chat/completions"}) or 0
    before = counted()
    backend.generate = generate
    with TestClient(create_app(GatewaySettings(max_tokens=100, health_interval_s=60), [backend])) as client:
        answered = client.post("/v1/chat/completions", json=CHAT)
        refused = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 101})
    assert answered.status_code == 200 and refused.status_code == 400
    overhead = {r: float(r.headers["x-rtxserve-overhead-ms"]) / 1000 for r in (answered, refused)}
    # the backend's 0.3 s are not the gateway's: its overhead fits in what the client waited less those, whatever the
    # machine's speed; a refusal's is all of its time
    assert answered.elapsed.total_seconds() >= 0.3 and 0 < overhead[answered] <= answered.elapsed.total_seconds() - 0.3
    assert 0 < overhead[refused] <= refused.elapsed.total_seconds()
    assert counted() - before == 2


def test_tokenize_and_detokenize_relay_to_the_models_engine_bounded_as_prompts_are(client, backend):
    r = client.post("/tokenize", json={"model": "llm-lora", "prompt": "hello", "add_special_tokens": False})
    assert r.status_code == 200 and backend.bodies[-1] == {"model": "llm-lora", "prompt": "hello",
                                                           "add_special_tokens": False}
    assert client.post("/tokenize", json={"model": "llm", "messages": [{"role": "user", "content": "hi"}],
                                          "add_generation_prompt": True}).status_code == 200
    assert client.post("/detokenize", json={"model": "llm", "tokens": [1, 2, 3]}).status_code == 200
    assert backend.bodies[-1] == {"model": "llm", "tokens": [1, 2, 3]}
    sent = len(backend.bodies)
    for path, body, status, message in (
            ("/tokenize", {"model": "llm", "prompt": "x" * 501}, 400,
             "the prompt has 501 characters; this gateway allows at most 500"),
            ("/tokenize", {"model": "llm", "messages": [{"role": "user", "content": "hi"}] * 9}, 400,
             "9 messages; this gateway allows at most 8"),
            ("/detokenize", {"model": "llm", "tokens": [1] * 501}, 400,
             "the tokens has 501 tokens; this gateway allows at most 500"),
            ("/detokenize", {"model": "llm", "tokens": [-1]}, 422, "tokens.0: Input should be greater than or equal to 0"),
            ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "nope")):
        error = error_of(client.post(path, json=body), status)
        assert message in f"{error['message']} {error['param']}"
    assert len(backend.bodies) == sent  # none reached the engine


def TypedStream(events: list[tuple[str, dict]], path: str, reads: int = 1, connection: list | None = None):
    """The typed-event stream parser over a canned Responses / Messages body (`event: <type>` and its JSON)."""
    from serve.gateway.backends.vllm import TYPED_EVENTS_END, TypedEventStream

    body = "".join(f"event: {kind}\ndata: {json.dumps(data)}\n\n" for kind, data in events).encode()
    size = -(-len(body) // reads)
    connection = connection if connection is not None else []

    async def arriving():
        for i in range(0, len(body), size):
            yield body[i:i + size]

    return TypedEventStream(arriving(), lambda: connection.append("closed"), "llm", ends=TYPED_EVENTS_END[path],
                            release=lambda: connection.append("released"))


MESSAGES_EVENTS = [
    ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 7, "output_tokens": 0}}}),
    ("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi\u2028"}}),
    ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3}}),
    ("message_stop", {"type": "message_stop"})]


@pytest.mark.parametrize("reads", [1, 7, 300])
def test_a_messages_stream_is_relayed_whole_and_its_usage_merged(client, backend, reads):
    def tokens(kind):
        line = f'rtxserve_tokens_total{{kind="{kind}",model="llm"}} '
        return sum(float(l[len(line):]) for l in client.get("/metrics").text.splitlines() if l.startswith(line))

    connection, before = [], (tokens("prompt"), tokens("completion"))
    backend.stream = TypedStream(MESSAGES_EVENTS, "/v1/messages", reads, connection)
    r = client.post("/v1/messages", json={"model": "llm", "max_tokens": 5, "stream": True,
                                          "messages": [{"role": "user", "content": "hi"}]})
    expected = "".join(f"event: {k}\ndata: {json.dumps(d)}\n\n" for k, d in MESSAGES_EVENTS)
    assert r.status_code == 200 and r.text == expected  # no [DONE]: message_stop ends it
    assert connection == ["released"]
    assert (tokens("prompt") - before[0], tokens("completion") - before[1]) == (7, 3)


def test_a_responses_stream_cut_short_or_with_an_error_ends_with_an_error_event(client, backend):
    created = ("response.created", {"type": "response.created", "response": {"usage": None}})
    delta = ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"})
    for events, connection in (([created, delta], []), ([created, ("error", {"type": "error", "message": "boom"})], [])):
        backend.stream = TypedStream(events, "/v1/responses", 3, connection)
        r = client.post("/v1/responses", json={"model": "llm", "input": "hi", "stream": True})
        last = r.text.strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: ") and "response.completed" not in r.text
        assert json.loads(last.split("data: ", 1)[1])["error"]["code"] == "backend_stream_error"
        assert connection == ["closed"]  # what aborts the generation in vLLM


def test_agent_apis_are_bounded_as_chat_is(client, backend):
    """Settings: max_tokens 100, max_messages 8, max_prompt_chars 500, max_tools 3."""
    cases = [("/v1/responses", {"input": "hi", "max_output_tokens": 101}, "max_output_tokens"),
             ("/v1/responses", {"input": "x" * 400, "instructions": "y" * 101}, "input"),
             ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 9}, "input"),
             ("/v1/messages", {"max_tokens": 101, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
             ("/v1/messages", {"max_tokens": 5, "system": "s" * 300,
                               "messages": [{"role": "user", "content": [{"type": "text", "text": "t" * 201}]}]},
              "messages"),
             ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                               "tools": [{"name": f"t{i}", "input_schema": {}} for i in range(4)]}, "tools"),
             ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]}, "messages")]
    for path, body, param in cases:
        assert error_of(client.post(path, json={"model": "llm", **body}), 400)["param"] == param, (path, body)
    assert not backend.bodies  # nothing reached vLLM
    r = client.post("/v1/responses", json={"model": "llm", "input": [{"type": "function_call_output", "call_id": "c1",
                                                                       "output": "sunny"}]})
    assert r.status_code == 200 and backend.bodies[-1]["max_output_tokens"] == 100  # left out: the bound is sent


def _event_stream(events, leave_after: bytes | None = None, wire: list | None = None):
    """EventStream over `events` in a task of its own: (the messages it sent, the task); the client leaves once
    `leave_after` was sent. `wire`: the messages sent to the server's own send (the scope's WIRE) go there."""
    import asyncio

    from serve.gateway.edge.event_stream import WIRE, EventStream

    sent, left = [], asyncio.Event()
    scope = {"type": "http"}

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if leave_after is not None and message.get("body") == leave_after:
            left.set()

    if wire is not None:
        async def to_wire(message):
            wire.append(message)

        scope[WIRE] = to_wire
    return sent, asyncio.ensure_future(EventStream(events)(scope, receive, send))


def test_an_event_streams_start_passes_the_middlewares_and_its_chunks_go_to_the_server_itself():
    """The answer's start is sent through `send` (the middlewares add their headers there); every chunk and the end go to
    the server's own send where the app put it in the scope, through no middleware's wrapper."""
    import asyncio

    async def events():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def run():
        wire = []
        sent, task = _event_stream(events(), wire=wire)
        await asyncio.wait_for(task, 5)
        return sent, wire

    sent, wire = asyncio.run(run())
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert [m["body"] for m in wire] == [b"data: 1\n\n", b"data: 2\n\n", b""] and wire[-1]["more_body"] is False


def test_a_streamed_answer_through_the_app_has_the_middlewares_headers_and_every_chunk(client, backend):
    """Through the whole app (the server's send in the scope): the request id and the overhead header on the start, the
    events whole after it."""
    backend.stream = FakeStream([_chunk("a"), _chunk("b"), "data: [DONE]"], reads="events")
    r = client.post("/v1/chat/completions", json={"model": "llm", "messages": [{"role": "user", "content": "x"}],
                                                  "stream": True}, headers={"x-request-id": "req-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-1" and "x-rtxserve-overhead-ms" in r.headers
    assert r.text == f"{_chunk('a')}\n\n{_chunk('b')}\n\ndata: [DONE]\n\n"


def test_an_event_stream_closes_its_events_the_moment_the_client_leaves():
    """Left while the stream waits for its next token: the events are closed there (the upstream closed: vLLM aborts
    the generation), nothing more is sent, and the request's task ends normally (not cancelled)."""
    import asyncio

    closed = []

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(3600)  # a token that never comes
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    async def run():
        sent, task = _event_stream(events(), leave_after=b"data: 1\n\n")
        await asyncio.wait_for(task, 5)
        return sent, task

    sent, task = asyncio.run(run())
    assert closed == [True] and not task.cancelled()
    assert sent[0]["type"] == "http.response.start" and [m["body"] for m in sent[1:]] == [b"data: 1\n\n"]


def test_an_event_stream_ends_its_answer_and_is_cancelled_by_others_as_any_task():
    """Run to its end: every event, then the answer's end; cancelled by someone else than its client (the server
    shutting down): the cancellation goes on up, the events closed on the way."""
    import asyncio

    closed = []

    async def events(wait: float):
        try:
            for i in range(3):
                await asyncio.sleep(wait)
                yield b"data: %d\n\n" % i
        finally:
            closed.append(wait)

    async def run():
        sent, task = _event_stream(events(0))
        await asyncio.wait_for(task, 5)
        _, stopped = _event_stream(events(3600))
        await asyncio.sleep(0.05)
        stopped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopped
        return sent

    sent = asyncio.run(run())
    assert [m.get("body") for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False and closed == [0, 3600]

"""Model aliases (a weighted split: canaries) and fallbacks in the gateway's settings, on fake backends: the split
follows the weights, a sticky alias keeps a key on one model, a model with no live replica is answered by its
fallback (never for a client's error), and bad settings are refused naming the alias."""

import dataclasses

import pytest
from fastapi.testclient import TestClient

from serve.gateway.access.keys import ApiKey, hash_key, write_keys
from serve.gateway.app import create_app
from serve.gateway.exceptions import BackendError
from serve.gateway.settings import GatewaySettings

from .fakes import MODELS, FakeTriton, error_of
from .test_generate import FakeVLLM

CLF = MODELS[0]
V2 = dataclasses.replace(CLF, name="clf-v2")


@pytest.fixture
def backends():
    return FakeTriton(models=(CLF,), url="a"), FakeTriton(models=(V2,), url="b")


def _client(backends, **settings):
    return TestClient(create_app(GatewaySettings(health_interval_s=60, **settings), list(backends)),
                      raise_server_exceptions=False)


def test_an_alias_splits_by_weight_and_each_answer_names_its_model(backends):
    with _client(backends, aliases={"reviews": {"clf": 90, "clf-v2": 10}}) as client:
        answers = [client.post("/v1/classify", json={"model": "reviews", "input": "good"}) for _ in range(200)]
        metrics = client.get("/metrics").text
        listed = client.get("/v1/models").json()["data"]
    assert all(r.status_code == 200 for r in answers)
    named = [r.json()["model"] for r in answers]
    assert [len(b.calls) for b in backends] == [named.count("clf"), named.count("clf-v2")]
    assert 150 <= named.count("clf") <= 195  # 180 expected; 7 standard deviations either side
    assert f'rtxserve_alias_requests_total{{alias="reviews",model="clf-v2"}} {named.count("clf-v2")}.0' in metrics
    alias = next(m for m in listed if m["id"] == "reviews")
    assert alias["alias_of"] == {"clf": 90, "clf-v2": 10} and alias["ready"] and alias["task"] == "text-classification"


def test_a_sticky_alias_keeps_each_key_on_one_model(backends, tmp_path):
    keys = {name: f"rtx-{name}-secret" for name in ("k1", "k2", "k3", "k4", "k5", "k6")}
    write_keys(tmp_path / "keys.json", {n: ApiKey(name=n, hash=hash_key(s)) for n, s in keys.items()})
    with _client(backends, keys_file=tmp_path / "keys.json",
                 aliases={"reviews": {"targets": {"clf": 50, "clf-v2": 50}, "sticky": "key"}}) as client:
        seen = {n: {client.post("/v1/classify", json={"model": "reviews", "input": "good"},
                                headers={"Authorization": f"Bearer {s}"}).json()["model"] for _ in range(5)}
                for n, s in keys.items()}
    assert all(len(models) == 1 for models in seen.values()), seen
    assert {m for models in seen.values() for m in models} == {"clf", "clf-v2"}  # 6 keys: both drawn (1 in 32 not)


def test_a_model_with_no_live_replica_is_answered_by_its_fallback_but_not_a_client_error(backends):
    with _client(backends, fallbacks={"clf": ["clf-v2"]}) as client:
        backends[0].up = False
        client.portal.call(client.app.state.gateway.registry.refresh)
        r = client.post("/v1/classify", json={"model": "clf", "input": "good"})
        assert r.status_code == 200 and r.json()["model"] == "clf-v2"
        assert 'rtxserve_fallbacks_total{fallback="clf-v2",model="clf"} 1.0' in client.get("/metrics").text
        backends[0].up = True
        client.portal.call(client.app.state.gateway.registry.refresh)
        backends[0].fail_with = BackendError("the model failed on this input")  # the model's answer, not an outage
        assert error_of(client.post("/v1/classify", json={"model": "clf", "input": "good"}), 502)
        assert error_of(client.post("/v1/classify", json={"model": "clf", "input": ["x"] * 1000}), 400)
        assert len(backends[1].calls) == 1  # neither went to the fallback


@pytest.mark.parametrize("settings, message", [
    ({"aliases": {"reviews": {"clf": 90, "clf-v2": 20}}}, "must be whole percents that sum to 100"),
    ({"aliases": {"reviews": {"reviews": 100}}}, "aliases.reviews: a target is an alias itself"),
    ({"fallbacks": {"clf": ["clf"]}}, "fallbacks.clf: name one or more other models"),
])
def test_bad_routes_are_settings_errors_naming_them(settings, message):
    with pytest.raises(ValueError, match=message):
        GatewaySettings(**settings)


def test_an_alias_naming_a_model_no_backend_serves_stops_the_start_naming_it(backends):
    with pytest.raises(RuntimeError, match="aliases or fallbacks name models no backend serves: clf-v3"):
        with _client(backends, aliases={"reviews": {"clf": 90, "clf-v3": 10}}):
            pass


class Engine(FakeVLLM):
    def __init__(self, url):
        super().__init__()
        self.url = url


def _chat(client, messages, **headers):
    r = client.post("/v1/chat/completions", json={"model": "llm", "messages": messages, "max_tokens": 4},
                    headers=headers)
    assert r.status_code == 200, r.text
    return r


def test_routing_by_prefix_is_on_by_default_and_hashes_only_where_several_replicas_serve_the_model(monkeypatch):
    """Affinity is a box's default; a model one replica serves has nothing to choose, and its prompts are not hashed."""
    from serve.gateway.generate import serving

    hashed = []
    real = serving.prefix_of
    monkeypatch.setattr(serving, "prefix_of", lambda *a, **kw: hashed.append(a[0]) or real(*a, **kw))
    assert GatewaySettings().affinity
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [Engine("a")])) as client:
        _chat(client, [{"role": "user", "content": "alone"}])
    assert hashed == []
    with TestClient(create_app(GatewaySettings(health_interval_s=60), [Engine("a"), Engine("b")])) as client:
        _chat(client, [{"role": "user", "content": "two of them"}])
    assert len(hashed) == 1 and "two of them" in hashed[0]


def test_a_conversation_stays_on_one_replica_and_conversations_spread():
    """Cache-aware routing: every turn of a conversation (its first two messages repeated) reaches the replica that
    holds its prefix; twenty conversations land on both replicas; an x-session-id overrides the content."""
    engines = [Engine("a"), Engine("b")]
    with TestClient(create_app(GatewaySettings(health_interval_s=60, affinity=True), engines)) as client:
        for n in range(20):
            history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"question {n}"}]
            for turn in range(3):
                _chat(client, history)
                history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {turn}"}]
            holders = [e for e in engines if any(b["messages"][1]["content"] == f"question {n}" for b in e.bodies)]
            assert len(holders) == 1, n
        assert all(len(e.bodies) >= 12 for e in engines)  # 60 turns, 20 conversations: both replicas have several
        before = [len(e.bodies) for e in engines]
        for n in range(6):  # one session, six different prompts: one replica
            _chat(client, [{"role": "user", "content": f"unrelated {n}"}], **{"x-session-id": "s-1"})
        grew = [len(e.bodies) - b for e, b in zip(engines, before)]
        assert sorted(grew) == [0, 6]


def test_a_hot_conversation_spills_to_the_other_replica_past_its_share():
    """Bounded load: while the replica a conversation hashes to carries more than affinity_load_factor x the average
    in flight, the conversation's next request goes to the other one; with affinity off, least busy."""
    engines = [Engine("a"), Engine("b")]
    with TestClient(create_app(GatewaySettings(health_interval_s=60, affinity=True), engines)) as client:
        state = client.app.state.gateway
        messages = [{"role": "user", "content": "the hot one"}]
        _chat(client, messages)
        home = next(r for r, e in zip(state.registry.replicas, engines) if e.bodies)
        home.in_flight = 4  # as if four streams of it were running there
        _chat(client, messages)
        home.in_flight = 0
        assert [len(e.bodies) for e in engines] == [1, 1]
    engines = [Engine("a"), Engine("b")]
    with TestClient(create_app(GatewaySettings(health_interval_s=60, affinity=False), engines)) as client:
        for _ in range(4):
            _chat(client, messages)
        assert [len(e.bodies) for e in engines] == [2, 2]


def test_a_new_conversation_goes_where_its_long_system_prompt_was_sent():
    """Prefix scoring: a system prompt of several blocks, sent once to one replica, draws a new conversation that
    opens with it to that replica (vLLM's prefix cache there holds it); a short one is left to least busy."""
    engines = [Engine("a"), Engine("b")]
    system = {"role": "system", "content": "You answer questions about orders. " * 20}  # 700 characters: 10 blocks
    with TestClient(create_app(GatewaySettings(health_interval_s=60, affinity=True), engines)) as client:
        _chat(client, [system, {"role": "user", "content": "first"}])
        home = next(i for i, e in enumerate(engines) if e.bodies)
        before = _preferred(client)
        for n in range(3):
            _chat(client, [system, {"role": "user", "content": f"another customer {n}"}])
        assert [len(e.bodies) for e in engines][home] == 4 and _preferred(client) - before == 3


def _preferred(client) -> float:
    line = next((l for l in client.get("/metrics").text.splitlines()
                 if l.startswith('rtxserve_affinity_total{outcome="preferred"}')), "x 0")
    return float(line.rsplit(" ", 1)[1])


def test_between_replicas_that_hold_a_prefix_the_one_with_fewer_tokens_in_flight_wins():
    engines = [Engine("a"), Engine("b")]
    messages = [{"role": "user", "content": "a question long enough to fill a few blocks of the prompt " * 4}]
    with TestClient(create_app(GatewaySettings(health_interval_s=60, affinity=True), engines)) as client:
        replicas = client.app.state.gateway.registry.replicas
        for r in replicas:  # both were sent it (one after a spill, say)
            r.prefixes.add(client.portal.call(_prefix_of, messages))
        replicas[0].tokens_in_flight = 5000  # a long generation running there
        _chat(client, messages)
        assert [len(e.bodies) for e in engines] == [0, 1]


async def _prefix_of(messages):
    from serve.gateway.fleet.prefix import prefix_of, prompt_text
    from serve.gateway.generate.protocol import ChatCompletionRequest
    from serve.gateway.generate.serving import conversation

    request = ChatCompletionRequest(model="llm", messages=messages, max_tokens=4)
    return prefix_of(prompt_text(messages, None), conversation(request, None, None), 64, 4)


def test_the_prefix_index_forgets_the_least_recently_sent_blocks_first():
    from serve.gateway.fleet.prefix import PrefixIndex, prefix_of

    index = PrefixIndex(capacity=12)
    old, new = prefix_of("x" * 640, "old", 64, 1), prefix_of("y" * 640, "new", 64, 1)  # 11 hashes each
    index.add(old)
    assert index.matched(old) == 11
    index.add(new)
    assert index.matched(new) == 11 and index.matched(old) == 0  # old's first block went: nothing of it leads

"""Several gateways over one set of on-demand models (fleet/decider.py): two gateway apps, each with its own event loop,
share one SQLite store and one fake swapping backend. One of them decides: a model both ask for is loaded once, a
model another gateway runs a request on is neither unloaded for room nor for idleness, one retired through any gateway
is unloaded by the decider once its requests end, a decider that dies is replaced within its lease, and one whose
lease was taken writes nothing more."""

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import exc as sa_exc

from serve.gateway.app import create_app
from serve.gateway.fleet.decider import LostLease, decisions, gateways as beats, leases
from serve.gateway.settings import GatewaySettings, OnDemand

from tests import until

from .fakes import SwappingTriton

NAMES = ("de", "fr", "es")
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def backend():
    return SwappingTriton(NAMES)


@contextlib.contextmanager
def gateways(backend, tmp_path, count=2, room=2.0, idle_unload_s=None, lease_s=5.0, **kw):
    """`count` gateway apps on one store; the backend's gates opened again on the way out, whatever failed, so that no
    held request outlives the test. A lease of 5 s, as by default: a busy machine's stall does not hand it over."""
    settings = GatewaySettings(health_interval_s=60, swap_room_gib=room, residency_lease_s=lease_s,
                               residency_store_url=f"sqlite:///{tmp_path / 'residency.sqlite'}",
                               on_demand={n: OnDemand(task="text-classification", gib=1.0, idle_unload_s=idle_unload_s)
                                          for n in NAMES}, **kw)
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(TestClient(create_app(settings, [backend]), raise_server_exceptions=False))
                   for _ in range(count)]
        stack.callback(backend.load_gate.set)  # before the clients stop (last in, first out), which waits for them
        stack.callback(backend.gate.set)
        until(lambda: sum(c.app.state.gateway.residency.deciding for c in clients) == 1, "one gateway decides")
        yield clients
    assert not any(backend.unloaded_under), f"a model was unloaded under a request: {backend.unloads}, " \
        f"{backend.unloaded_under} requests held at each"


def residency(client):
    return client.app.state.gateway.residency


def decider_first(clients):
    """The clients, the deciding gateway's first."""
    return sorted(clients, key=lambda c: not residency(c).deciding)


def classify(client, model):
    return client.post("/v1/classify", json={"model": model, "input": "good"})


def test_a_model_every_gateway_asks_for_at_once_is_loaded_once(backend, tmp_path):
    with ThreadPoolExecutor(8) as pool, gateways(backend, tmp_path) as clients:
        backend.load_gate.clear()
        answers = [pool.submit(classify, clients[i % 2], "de") for i in range(8)]
        until(lambda: sum(residency(c).waiting["de"] for c in clients) == 8 and backend.loads == ["de"],
              "every request waiting on one load")
        backend.load_gate.set()
        assert [a.result().status_code for a in answers] == [200] * 8
        assert backend.loads == ["de"] and all(residency(c).status()["de"]["state"] == "loaded" for c in clients)


def test_room_is_made_from_a_model_no_gateway_runs_a_request_on(backend, tmp_path):
    """Room for two: fr is the least recently used, but the other gateway runs a request on it, so de makes way."""
    with ThreadPoolExecutor(2) as pool, gateways(backend, tmp_path) as clients:
        deciding, other = decider_first(clients)
        assert classify(deciding, "fr").status_code == 200 and classify(deciding, "de").status_code == 200
        backend.gate.clear()  # classify calls wait, the loaded model's first request too
        held = pool.submit(classify, other, "fr")
        until(lambda: backend.holding == 1, "the other gateway's request on fr")
        loading = pool.submit(classify, deciding, "es")
        until(lambda: backend.loads[-1:] == ["es"], "es loaded")
        assert backend.unloads == ["de"] and backend.loaded == {"fr", "es"}
        backend.gate.set()
        assert held.result().status_code == loading.result().status_code == 200


def test_a_model_another_gateway_runs_a_request_on_is_not_unloaded_for_room(backend, tmp_path):
    """Room for one, held by the other gateway's request: the load waits its bound and answers 503 saying why."""
    with ThreadPoolExecutor(2) as pool, gateways(backend, tmp_path, room=1.0, load_wait_s=1.0) as clients:
        deciding, other = decider_first(clients)
        # loaded for the other gateway within the short wait, or answered 503 while it loads (a busy machine)
        until(lambda: classify(other, "de").status_code == 200, "de loaded for the other gateway")
        backend.gate.clear()
        held = pool.submit(classify, other, "de")
        until(lambda: backend.holding == 1, "the other gateway's request on de")
        # bounded: were de unloaded, fr would load and its request wait at the closed gate; on a busy machine the
        # first refusal may come before the decider has written why ("still loading")
        def refused_saying_why() -> bool:
            refused = pool.submit(classify, deciding, "fr").result(timeout=20)
            assert refused.status_code == 503, refused.text
            return "held by models serving requests (de)" in refused.text

        until(refused_saying_why, "fr refused, naming the model that holds the room")
        assert backend.unloads == [] and backend.loaded == {"de"}
        backend.gate.set()
        assert held.result().status_code == 200
        until(lambda: classify(deciding, "fr").status_code == 200, "fr loaded once de is idle")
        assert backend.unloads == ["de"]


def test_an_idle_unload_waits_for_another_gateway_s_request_and_happens_once_it_ends(backend, tmp_path):
    with ThreadPoolExecutor(1) as pool, gateways(backend, tmp_path, idle_unload_s=0.5) as clients:
        deciding, other = decider_first(clients)
        # loaded for the other gateway within the short wait, or answered 503 while it loads (a busy machine)
        until(lambda: classify(other, "de").status_code == 200, "de loaded for the other gateway")
        backend.gate.clear()
        held = pool.submit(classify, other, "de")
        until(lambda: backend.holding == 1, "the request held on de")
        # five times the idle time (a drain takes a beat or two): still loaded, the request still runs
        with pytest.raises(AssertionError):
            until(lambda: backend.unloads, limit_s=2.5)
        assert backend.holding == 1 and backend.loaded == {"de"}
        backend.gate.set()
        assert held.result().status_code == 200
        until(lambda: backend.unloads == ["de"], "de unloaded once idle everywhere")
        assert classify(other, "de").status_code == 200 and backend.loads == ["de", "de"]


def test_a_decider_that_dies_is_replaced_within_its_lease_and_the_next_loads(backend, tmp_path, monkeypatch):
    with gateways(backend, tmp_path, lease_s=1.0) as clients:
        deciding, other = decider_first(clients)
        assert classify(other, "de").status_code == 200 and backend.loads == ["de"]
        dead = residency(deciding)
        monkeypatch.setattr(dead, "_leave", lambda: None)  # dies: neither its row nor its lease is given up
        deciding.__exit__(None, None, None)
        until(lambda: residency(other).deciding, "the other gateway decides", limit_s=10)
        assert classify(other, "fr").status_code == 200 and backend.loads == ["de", "fr"]
        assert residency(other).status()["de"]["state"] == "loaded"


def test_a_model_retired_through_a_gateway_that_does_not_decide_is_unloaded_once_its_request_ends(backend, tmp_path):
    with ThreadPoolExecutor(1) as pool, gateways(backend, tmp_path) as clients:
        deciding, other = decider_first(clients)
        until(lambda: classify(other, "de").status_code == 200, "de loaded")
        backend.gate.clear()
        held = pool.submit(classify, deciding, "de")
        until(lambda: backend.holding == 1, "a request held on de")
        said = other.portal.call(residency(other).unload, "de", "retired")
        assert "unloads it once no gateway runs a request on it" in said
        with pytest.raises(AssertionError):  # four beats: the request still runs, de stays
            until(lambda: backend.unloads, limit_s=2.0)
        backend.gate.set()
        assert held.result().status_code == 200
        until(lambda: backend.unloads == ["de"], "de unloaded by the decider once its request ended")
        until(lambda: not residency(other)._retired, "the retirement done")


def test_a_request_that_gave_up_waiting_leaves_nothing_wanted(backend, tmp_path):
    with gateways(backend, tmp_path, load_wait_s=0.5) as clients:
        _, other = decider_first(clients)
        backend.load_gate.clear()  # the load hangs
        assert classify(other, "de").status_code == 503

        def wanted():
            with residency(other).engine.connect() as db:
                return db.execute(sa.select(beats.c.wanted).where(beats.c.name == residency(other).name)).scalar()

        until(lambda: wanted() == [], "the other gateway's beat wants nothing")


def test_a_decider_whose_lease_was_taken_writes_no_decision_and_stops_deciding(backend, tmp_path):
    with gateways(backend, tmp_path) as clients:
        deciding, _ = decider_first(clients)
        stalled = residency(deciding)
        with stalled.engine.begin() as db:  # another gateway took the lease while this one stalled
            db.execute(leases.update().values(holder="elsewhere", until=time.time() + 3600))
        with pytest.raises(LostLease):
            deciding.portal.call(stalled._decided, "de", "loaded")
        assert not stalled.deciding
        with stalled.engine.connect() as db:
            assert db.execute(sa.select(decisions)).all() == []


def test_a_gateway_that_cannot_beat_starts_no_request_on_an_on_demand_model(backend, tmp_path, monkeypatch):
    """Taken for dead once its beat is a lease old, it might have a model unloaded under it: it waits, then 503."""
    with gateways(backend, tmp_path, lease_s=1.0, load_wait_s=0.5) as clients:
        _, other = decider_first(clients)
        until(lambda: classify(other, "de").status_code == 200, "de loaded")

        def down(row):
            raise sa_exc.OperationalError("beat", {}, Exception("the database is down"))

        monkeypatch.setattr(residency(other), "_publish", down)
        until(lambda: not residency(other).beating, "its beats a lease old")
        refused = classify(other, "de")
        assert refused.status_code == 503 and "residency store" in refused.text
        monkeypatch.undo()
        until(lambda: classify(other, "de").status_code == 200, "served again once its beats go through")
        assert backend.loads == ["de"]

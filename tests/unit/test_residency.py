"""On-demand models in the gateway, against a fake swapping backend: one load for many first requests, the least
recently used idle model makes room, a model with a request in flight is never unloaded, bounded waits answer 503
with Retry-After, failed loads back off, idle models go."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from serve.gateway.app import create_app
from serve.gateway.exceptions import BackendError
from serve.gateway.settings import GatewaySettings, OnDemand

from tests import until

from .fakes import SwappingTriton, error_of

NAMES = ("de", "fr", "es")
pytestmark = pytest.mark.timeout(60)  # a broken residency may leave a request waiting: fail, do not hang


SHARED: dict[str, str] = {}  # the settings of the mode under test


@pytest.fixture(autouse=True, params=["alone", "decider"])
def mode(request, tmp_path, monkeypatch):
    """Each test twice: the gateway deciding alone (residency.py), and as the decider of a shared store
    (decider.py), which must behave the same for one gateway."""
    if request.param == "decider":
        monkeypatch.setitem(SHARED, "residency_store_url", f"sqlite:///{tmp_path / 'residency.sqlite'}")
    return request.param


def settings(room: float = 2.0, **kw) -> GatewaySettings:
    idle = kw.pop("idle_unload_s", None)
    return GatewaySettings(health_interval_s=60, on_demand={n: OnDemand(task="text-classification", gib=1.0,
                                                                         idle_unload_s=idle) for n in NAMES},
                           swap_room_gib=room, **SHARED, **kw)


@pytest.fixture
def backend():
    return SwappingTriton(NAMES)


def client_for(backend, **kw):
    return TestClient(create_app(settings(**kw), [backend]), raise_server_exceptions=False)


def classify(client, model):
    return client.post("/v1/classify", json={"model": model, "input": "good"})


def test_nothing_on_demand_is_loaded_at_start_and_the_gateway_is_ready_and_lists_them(backend):
    with client_for(backend) as client:
        assert client.get("/readyz").status_code == 200 and backend.loads == []
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["de"]["task"] == "text-classification" and listed["de"]["ready"] is False
        assert listed["de"]["on_demand"] == {"state": "unloaded", "gib": 1.0, "in_flight": 0, "waiting": 0,
                                             "idle_unload_s": None}
        assert "on_demand" not in listed["clf"]


def test_ten_concurrent_first_requests_cause_one_load(backend):
    with client_for(backend) as client:
        backend.load_gate.clear()  # the load waits until every request has arrived
        with ThreadPoolExecutor(10) as pool:
            answers = [pool.submit(classify, client, "de") for _ in range(10)]
            residency = client.app.state.gateway.residency
            until(lambda: residency.waiting["de"] == 10 and backend.loads == ["de"])
            backend.load_gate.set()
            codes = [a.result().status_code for a in answers]
        assert codes == [200] * 10 and backend.loads == ["de"]
        assert residency.status()["de"]["state"] == "loaded"


def test_the_least_recently_used_idle_model_makes_room(backend):
    with client_for(backend) as client:
        for model in ("de", "fr", "de", "es"):  # room for two: es needs fr's place (de was used after fr)
            assert classify(client, model).status_code == 200
        assert backend.loads == ["de", "fr", "es"] and backend.unloads == ["fr"]
        assert backend.loaded == {"de", "es"}


def test_a_model_with_a_request_in_flight_is_never_unloaded(backend):
    with client_for(backend, room=2.0) as client, ThreadPoolExecutor(2) as pool:
        assert classify(client, "fr").status_code == 200
        assert classify(client, "de").status_code == 200  # fr is now the least recently used
        backend.gate.clear()  # classify calls (the loaded model's first request too) wait until it opens
        held = pool.submit(classify, client, "fr")
        until(lambda: backend.holding == 1)
        loading = pool.submit(classify, client, "es")  # needs a place: fr is busy, so de goes
        until(lambda: backend.unloads)
        backend.gate.set()
        assert held.result().status_code == loading.result().status_code == 200
        assert backend.unloads == ["de"] and backend.loaded == {"fr", "es"}


def test_when_every_model_is_busy_a_load_waits_its_bound_then_503_with_retry_after(backend):
    with client_for(backend, room=1.0, load_wait_s=0.5) as client, ThreadPoolExecutor(1) as pool:
        assert classify(client, "de").status_code == 200
        backend.gate.clear()
        held = pool.submit(classify, client, "de")
        until(lambda: backend.holding == 1)
        refused = classify(client, "fr")
        backend.gate.set()
        assert held.result().status_code == 200
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert "held by models serving requests (de)" in error_of(refused, 503)["message"]
        assert backend.unloads == [] and "fr" not in backend.loaded
        # de is idle now: fr loads in its place (a 503 while a busy machine's load passes the short wait is allowed)
        until(lambda: classify(client, "fr").status_code == 200, "fr loaded once de is idle")
        assert backend.unloads == ["de"]


def test_a_load_longer_than_the_wait_answers_503_and_goes_on(backend):
    with client_for(backend, load_wait_s=0.3) as client:
        backend.load_gate.clear()
        slow = classify(client, "de")
        assert slow.status_code == 503 and int(slow.headers["Retry-After"]) >= 1
        assert "still loading" in error_of(slow, 503)["message"]
        backend.load_gate.set()
        until(lambda: "de" in backend.loaded)
        assert classify(client, "de").status_code == 200 and backend.loads == ["de"]  # the first load, finished


def test_a_failed_load_is_503_naming_it_backs_off_and_leaves_the_others_alone(backend):
    backend.load_fails["de"] = BackendError("Triton could not load model de: failed to open model.onnx")
    with client_for(backend, load_retry_s=0.5) as client:
        first = classify(client, "de")
        assert first.status_code == 503 and "failed to open model.onnx" in error_of(first, 503)["message"]
        again = classify(client, "de")  # within the backoff: refused without another try
        assert again.status_code == 503 and backend.loads == ["de"] and "next try" in error_of(again, 503)["message"]
        assert classify(client, "clf").status_code == 200 and classify(client, "fr").status_code == 200
        backend.load_fails.clear()
        until(lambda: classify(client, "de").status_code == 200, "de loaded once its backoff (0.5 s) is over")
        assert backend.loads == ["de", "fr", "de"]  # refused within the backoff without a try


def test_a_loaded_model_missed_by_one_discovery_is_checked_again_and_served(backend):
    """A backend busy just after a load (a CPU engine that has just started) misses one discovery: the load waits for
    the next check, a second later, instead of failing."""
    with client_for(backend) as client:
        backend.load_gate.clear()
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(classify, client, "de")
            until(lambda: backend.loads == ["de"])
            backend.discover_misses = 1
            backend.load_gate.set()
            assert first.result().status_code == 200
        assert backend.discover_misses == 0 and backend.loads == ["de"]


def test_an_idle_model_is_unloaded_after_its_idle_time(backend):
    with client_for(backend, idle_unload_s=0.2) as client:
        assert classify(client, "de").status_code == 200 and classify(client, "fr").status_code == 200
        until(lambda: not backend.loaded)  # the idle loop's work, every 0.05 s
        assert backend.loaded == set() and sorted(backend.unloads) == ["de", "fr"]
        assert client.get("/readyz").status_code == 200


def test_the_room_setting_must_hold_each_model():
    with pytest.raises(ValueError, match="de \\(3 GiB\\) cannot fit in swap_room_gib 2"):
        GatewaySettings(on_demand={"de": OnDemand(task="text-classification", gib=3)}, swap_room_gib=2)


def test_gateways_sharing_the_batch_api_s_database_do_not_share_a_decider_unless_told():
    """Two boxes, each with its own engines, may share the Batch API's PostgreSQL: a decider on one would load on its
    own backends only, so residency is shared only where residency_store_url says so."""
    url = "postgresql://rtx@db.example.com/rtxserve"
    assert GatewaySettings(batch_store_url=url).residency_store() == ("", None)
    assert GatewaySettings(batch_store_url=url, residency_store_url=url).residency_store() == (url, None)


def test_loads_of_two_models_that_fit_together_overlap(backend):
    """A slow load (an engine's start) does not hold up another model's (a classifier's), room permitting."""
    with client_for(backend, room=2.0) as client, ThreadPoolExecutor(2) as pool:
        backend.load_gate.clear()
        slow = pool.submit(classify, client, "de")
        until(lambda: backend.loads == ["de"])
        other = pool.submit(classify, client, "fr")
        until(lambda: backend.loads == ["de", "fr"])  # started while de's load still runs
        backend.load_gate.set()
        assert slow.result().status_code == other.result().status_code == 200


def test_a_model_back_loaded_on_its_own_counts_in_the_room_and_makes_way(backend):
    """A supervisor's restart brings an engine back awake without the gateway (a Kubernetes sidecar, whose one-shot
    sleep ran at the pod's start only; a container Docker restarted): from the next refresh it counts as loaded, so the
    room is never over-committed, and it is put back to sleep like any other when the room is needed."""
    with client_for(backend) as client:
        residency = client.app.state.gateway.residency
        assert classify(client, "de").status_code == 200
        backend.loaded.add("fr")  # back awake, no load of the gateway's
        client.portal.call(client.app.state.gateway.registry.refresh)
        until(lambda: residency.status()["fr"]["state"] == "loaded")
        assert residency.used_gib() == 2.0
        assert classify(client, "es").status_code == 200  # room for two: one of them made way, not a third awake
        assert backend.loads == ["de", "es"] and len(backend.unloads) == 1 and len(backend.loaded) == 2
        assert classify(client, "fr" if "fr" in backend.loaded else "de").status_code == 200
        assert len(backend.loaded) == 2

"""Promotions in the gateway (serve/gateway/rollout/, admin/promotions.py), in process on the fake Triton: each step
moves the name's route; the state is one file every worker follows; a lease not renewed ends the promotion as its
step allows; a start finds no half-switched name; the shadow step copies requests to the candidate and counts whether
the answers agree; the admin routes refuse what is not a promotion, naming why."""

import asyncio
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from serve.gateway.app import create_app
from serve.gateway.backends.base import Classification, ModelInfo
from serve.gateway.fleet.rollout import table as rollout_table
from serve.gateway.fleet.rollout.store import RolloutStore, Snapshot
from serve.gateway.fleet.rollout.table import PromotionConflict, Rollout
from serve.gateway.settings import GatewaySettings

from .fakes import LABELS, FakeTriton, error_of
from .test_auth import bearer, make_key


def rollout(path=None, retired=None) -> Rollout:
    async def retire(name):
        (retired if retired is not None else []).append(name)
        return "unloaded"

    return Rollout(GatewaySettings(rollout_file=path, health_interval_s=60), retire)


def test_each_step_moves_the_route_and_the_finish_retires_the_model_it_replaced(tmp_path):
    retired = []
    r = rollout(tmp_path / "rollout.json", retired)
    p = r.begin("clf", "clf", "clf-v2", lease_s=60)
    assert r.routes == {} and r.watching == {"clf": "clf", "clf-v2": "clf"} and r.pinned == {"clf", "clf-v2"}
    r.step("clf", p.id, phase="shadow", weight=0, shadow=0.25, lease_s=60)
    assert r.shadows == {"clf": ("clf-v2", 0.25, "clf")} and r.routes == {}
    r.step("clf", p.id, phase="canary", weight=25, shadow=0.0, lease_s=60)
    assert r.routes["clf"].targets == {"clf": 75, "clf-v2": 25} and r.shadows == {}
    r.step("clf", p.id, phase="switched", weight=0, shadow=0.0, lease_s=60)
    assert r.routes["clf"].targets == {"clf-v2": 100}
    done = asyncio.run(r.finish("clf", p.id))
    assert done.phase == "done" and retired == ["clf"] and done.reason == "finished; clf unloaded"
    assert r.retired == {"clf"} and r.snapshot.promotions == {} and r.routes["clf"].targets == {"clf-v2": 100}
    # a second promotion of the name starts from the model the first put in front, and a rollback restores that route
    q = r.begin("clf", "clf-v2", "clf-v3", lease_s=60)
    r.step("clf", q.id, phase="canary", weight=50, shadow=0.0, lease_s=60)
    r.rollback("clf", q.id, "by hand")
    assert r.routes["clf"].targets == {"clf-v2": 100} and [h.phase for h in r.snapshot.history] == ["done", "rolled_back"]


def test_a_rollback_before_the_switch_gives_the_name_back_to_its_model():
    r = rollout()
    p = r.begin("clf", "clf", "clf-v2", lease_s=60)
    r.step("clf", p.id, phase="canary", weight=10, shadow=0.0, lease_s=60)
    ended = r.rollback("clf", p.id, "P99 over the bound")
    assert ended.phase == "rolled_back" and ended.reason == "P99 over the bound" and r.routes == {} and r.pinned == set()


@pytest.mark.parametrize("first, then, says", [("canary", "shadow", "cannot go to shadow"),
                                               ("switched", "canary", "cannot go to canary")])
def test_a_step_backwards_is_refused(first, then, says):
    r = rollout()
    p = r.begin("clf", "clf", "clf-v2", lease_s=60)
    r.step("clf", p.id, phase=first, weight=10, shadow=0.0, lease_s=60)
    with pytest.raises(PromotionConflict, match=says):
        r.step("clf", p.id, phase=then, weight=10, shadow=0.1, lease_s=60)


def test_a_second_promotion_of_a_name_and_a_step_of_an_ended_one_are_refused():
    r = rollout()
    p = r.begin("clf", "clf", "clf-v2", lease_s=60)
    with pytest.raises(PromotionConflict, match=f"a promotion of clf is running \\({p.id}"):
        r.begin("clf", "clf", "clf-v3", lease_s=60)
    r.rollback("clf", p.id, "by hand")
    with pytest.raises(PromotionConflict, match=f"{p.id} has ended: rolled back \\(by hand\\)"):
        r.step("clf", p.id, phase="canary", weight=10, shadow=0.0, lease_s=60)


def test_every_worker_follows_the_file_another_wrote(tmp_path):
    one, two = rollout(tmp_path / "rollout.json"), rollout(tmp_path / "rollout.json")
    p = one.begin("clf", "clf", "clf-v2", lease_s=60)
    one.step("clf", p.id, phase="canary", weight=50, shadow=0.0, lease_s=60)
    assert two.routes == {}
    asyncio.run(two.refresh())
    assert two.routes["clf"].targets == {"clf": 50, "clf-v2": 50} and two.watching == one.watching


@pytest.mark.parametrize("phase, ended, route", [("canary", "rolled_back", None), ("switched", "done", {"clf-v2": 100})])
def test_a_lease_not_renewed_ends_the_promotion_as_its_step_allows(phase, ended, route):
    r = rollout()
    p = r.begin("clf", "clf", "clf-v2", lease_s=60)
    r.step("clf", p.id, phase=phase, weight=50, shadow=0.0, lease_s=0.01)
    time.sleep(0.02)
    asyncio.run(r.refresh())
    last = r.snapshot.history[-1]
    assert last.phase == ended and "stopped renewing its lease" in last.reason
    assert (r.routes["clf"].targets if route else None) == route


def test_a_lease_another_worker_renewed_is_not_ended_by_one_that_saw_it_run_out(tmp_path):
    one, two = rollout(tmp_path / "rollout.json"), rollout(tmp_path / "rollout.json")
    p = one.begin("clf", "clf", "clf-v2", lease_s=0.01)
    asyncio.run(two.refresh())
    one.step("clf", p.id, phase="started", weight=0, shadow=0.0, lease_s=60)  # the driver renews it, through `one`
    time.sleep(0.02)
    with pytest.raises(PromotionConflict, match="lease was renewed"):  # `two`'s view says it ran out; the file does not
        two.rollback("clf", p.id, "expired", expired=True)
    asyncio.run(two.refresh())
    assert two.snapshot.promotions["clf"].id == p.id


@pytest.mark.parametrize("phase, ended, route", [("shadow", "rolled_back", None), ("canary", "rolled_back", None),
                                                 ("switched", "done", {"clf-v2": 100})])
def test_a_start_finds_no_half_switched_name(tmp_path, monkeypatch, phase, ended, route):
    before = rollout(tmp_path / "rollout.json")
    p = before.begin("clf", "clf", "clf-v2", lease_s=600)
    before.step("clf", p.id, phase=phase, weight=50, shadow=0.5, lease_s=600)
    monkeypatch.setattr(rollout_table, "BOOT", "the next start")
    after = rollout(tmp_path / "rollout.json")  # the gateway killed and started again
    asyncio.run(after.start())
    last = after.snapshot.history[-1]
    assert last.phase == ended and "restarted" in last.reason and after.snapshot.promotions == {}
    assert (after.routes["clf"].targets if route else None) == route


def test_a_worker_that_starts_beside_running_ones_leaves_their_promotion_running(tmp_path):
    """A second worker ready after the first had begun a promotion (or one started again after a crash) is not a
    restart of the gateway: in a CI run such a late worker rolled back a promotion its sibling had just begun."""
    first = rollout(tmp_path / "rollout.json")
    p = first.begin("clf", "clf", "clf-v2", lease_s=600)
    first.step("clf", p.id, phase="canary", weight=50, shadow=0.0, lease_s=600)
    late = rollout(tmp_path / "rollout.json")  # the same start of the gateway (the same BOOT)
    asyncio.run(late.start())
    assert late.snapshot.promotions["clf"].id == p.id and late.snapshot.history == []
    assert late.routes["clf"].targets == {"clf": 50, "clf-v2": 50}


def test_a_damaged_rollout_file_is_named(tmp_path):
    (tmp_path / "rollout.json").write_text("{not json")
    with pytest.raises(Exception, match="rollout.json cannot be read .* move it aside"):
        RolloutStore(tmp_path / "rollout.json").read()
    assert RolloutStore(tmp_path / "missing.json").read() == Snapshot()


# --- through the gateway ----------------------------------------------------------------------------------------

class TwoVersions(FakeTriton):
    """clf and clf-v2 (v2 labels everything "pos"), and ner of another task; counts the calls each model answered."""

    def __init__(self):
        extra = (ModelInfo("clf-v2", "text-classification", "triton", True, LABELS, 4),
                 ModelInfo("clf-other", "text-classification", "triton", True, ("a", "b"), 4))
        super().__init__()
        self.models += list(extra)
        self.answered: list[str] = []

    async def classify(self, model, texts, timeout_s):
        self.answered.append(model.name)
        label = "pos" if model.name == "clf-v2" else "neg"
        return [Classification(label, 0.9, {"neg": 0.1, "pos": 0.9}) for _ in texts]


@pytest.fixture
def keyed(tmp_path, capsys):
    path = tmp_path / "keys.json"
    return path, {"admin": make_key(path, capsys, "--name", "admin", "--admin"),
                  "app": make_key(path, capsys, "--name", "app", "--models", "clf")}


@pytest.fixture
def box(tmp_path, keyed):
    backend = TwoVersions()
    settings = GatewaySettings(keys_file=keyed[0], health_interval_s=60, rollout_file=tmp_path / "rollout.json")
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c, backend, bearer(keyed[1]["admin"]), bearer(keyed[1]["app"])


def _counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_promotion_driven_through_the_admin_routes_moves_what_a_key_of_the_name_gets(box):
    client, backend, admin, app = box
    begun = client.post("/admin/promotions", json={"model": "clf", "candidate": "clf-v2"}, headers=admin)
    assert begun.status_code == 201, begun.text
    pid = begun.json()["id"]
    step = client.patch("/admin/promotions/clf", json={"id": pid, "phase": "switched"}, headers=admin)
    assert step.status_code == 200 and step.json()["phase"] == "switched"
    answer = client.post("/v1/classify", json={"model": "clf", "input": "x"}, headers=app)  # a key for "clf" only
    assert answer.status_code == 200 and answer.json()["model"] == "clf-v2"
    listed = {m["id"]: m for m in client.get("/v1/models", headers=admin).json()["data"]}
    assert listed["clf"]["alias_of"] == {"clf-v2": 100} and listed["clf"]["backend"] == "alias"
    done = client.post("/admin/promotions/clf/finish", json={"id": pid}, headers=admin)
    assert done.status_code == 200 and done.json()["phase"] == "done"
    state = client.get("/admin/promotions", headers=admin).json()
    assert state["routes"] == {"clf": {"clf-v2": 100}} and state["retired"] == ["clf"] and state["promotions"] == []
    assert "clf" not in {m["id"] for m in client.get("/v1/models", headers=admin).json()["data"] if "alias_of" not in m}
    assert client.get("/readyz").status_code == 200  # the retired model is not required; the name is, through its route


def test_the_shadow_step_sends_requests_again_to_the_candidate_and_counts_whether_they_agree(box):
    client, backend, admin, app = box
    pid = client.post("/admin/promotions", json={"model": "clf", "candidate": "clf-v2"}, headers=admin).json()["id"]
    assert client.patch("/admin/promotions/clf", json={"id": pid, "phase": "shadow", "shadow": 1.0},
                        headers=admin).status_code == 200
    before = _counter("rtxserve_rollout_requests_total", model="clf", target="clf-v2", role="shadow", outcome="disagree")
    for _ in range(3):
        answer = client.post("/v1/classify", json={"model": "clf", "input": "x"}, headers=app)
        assert answer.status_code == 200 and answer.json()["model"] == "clf"  # the client's answer: the current model's
    deadline = time.monotonic() + 5
    while backend.answered.count("clf-v2") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.answered.count("clf") == 3 and backend.answered.count("clf-v2") == 3
    after = _counter("rtxserve_rollout_requests_total", model="clf", target="clf-v2", role="shadow", outcome="disagree")
    assert after - before == 3  # v2 labels "pos" where v1 says "neg"


@pytest.mark.parametrize("body, status, says", [
    ({"model": "clf", "candidate": "ner"}, 400, "ner is a token-classification model and clf a text-classification one"),
    ({"model": "clf", "candidate": "clf-other"}, 400, "labels neg, pos gone, a, b added"),
    ({"model": "clf", "candidate": "clf"}, 400, "clf already serves clf"),
    ({"model": "clf", "candidate": "nope"}, 404, "no model 'nope'"),
    ({"model": "nope", "candidate": "clf-v2"}, 404, "no model 'nope'"),
])
def test_what_is_not_a_promotion_is_refused_naming_why(box, body, status, says):
    client, _, admin, _ = box
    r = client.post("/admin/promotions", json=body, headers=admin)
    assert says in error_of(r, status)["message"]
    assert client.get("/admin/promotions", headers=admin).json()["promotions"] == []


def test_a_second_promotion_is_409_one_that_runs_no_more_404_and_only_admin_keys_promote(box):
    client, _, admin, app = box
    assert client.post("/admin/promotions", json={"model": "clf", "candidate": "clf-v2"}, headers=admin).status_code == 201
    again = client.post("/admin/promotions", json={"model": "clf", "candidate": "clf-v2"}, headers=admin)
    assert "a promotion of clf is running" in error_of(again, 409)["message"]
    assert client.post("/admin/promotions/clf/rollback", json={}, headers=app).status_code == 403
    back = client.post("/admin/promotions/clf/rollback", json={}, headers=admin)
    assert back.status_code == 200 and back.json()["reason"] == "rolled back by hand"
    ended = client.post("/admin/promotions/clf/finish", json={"id": back.json()["id"]}, headers=admin)
    assert "has ended: rolled back" in error_of(ended, 409)["message"]  # that promotion exists, in its history
    for method, path in (("PATCH", "/admin/promotions/clf"), ("POST", "/admin/promotions/clf/rollback"),
                         ("POST", "/admin/promotions/nope/finish")):
        none = client.request(method, path, json={"id": "p-none", "phase": "canary", "weight": 10} if method == "PATCH" else {},
                              headers=admin)
        assert "is running" in error_of(none, 404)["message"]  # no promotion of that name runs: as absent as a file


def test_a_gateway_whose_replicas_share_no_state_refuses_promotions(tmp_path, keyed):
    settings = GatewaySettings(keys_file=keyed[0], health_interval_s=60, promotions=False)
    with TestClient(create_app(settings, [TwoVersions()]), raise_server_exceptions=False) as client:
        r = client.post("/admin/promotions", json={"model": "clf", "candidate": "clf-v2"},
                        headers=bearer(keyed[1]["admin"]))
    assert "promotions are off on this gateway" in error_of(r, 409)["message"]


def test_a_candidate_that_takes_nothing_in_leaves_its_requests_to_the_model_it_would_replace(box):
    """The candidate down (its server gone, its model unloaded): the canary's share is answered by the current model,
    and counted as the candidate's errors, which roll the promotion back."""
    from serve.gateway.exceptions import BackendUnavailable

    client, backend, admin, app = box
    answer = backend.classify

    async def gone(model, texts, timeout_s):
        if model.name == "clf-v2":
            raise BackendUnavailable("model clf-v2 is not available right now")
        return await answer(model, texts, timeout_s)

    backend.classify = gone
    pid = client.post("/admin/promotions", json={"model": "clf", "candidate": "clf-v2"}, headers=admin).json()["id"]
    assert client.patch("/admin/promotions/clf", json={"id": pid, "phase": "canary", "weight": 100},
                        headers=admin).status_code == 200
    before = _counter("rtxserve_rollout_requests_total", model="clf", target="clf-v2", role="candidate", outcome="error")
    backend.answered.clear()
    answers = [client.post("/v1/classify", json={"model": "clf", "input": "x"}, headers=app) for _ in range(3)]
    assert [(a.status_code, a.json()["data"][0]["label"]) for a in answers] == [(200, "neg")] * 3  # v1's answers
    assert backend.answered == ["clf"] * 3
    assert _counter("rtxserve_rollout_requests_total", model="clf", target="clf-v2", role="candidate",
                    outcome="error") - before == 3

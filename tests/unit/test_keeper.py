"""The keeper of a `serve up` box (deploy/keeper.py) with `up` faked: which servers it starts again and when, what it
counts, and when it ends. tests/integration/test_serve_up.py kills a real box's gateway."""

import json
import time
from types import SimpleNamespace

import pytest

from deploy import keeper as keeper_module
from deploy.box import BoxBusy
from deploy.box_state import RESTARTS_FILE
from deploy.keeper import Keeper, backoff_s
from serve.launcher import ServerStartError


def test_backoff_doubles_from_10_s_to_5_minutes_as_kubernetes_does():
    assert [backoff_s(n) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]


@pytest.fixture
def box(tmp_path, monkeypatch):
    """A run folder whose state names a live server (Triton) and a dead one (the gateway); `up` recorded, not run."""
    state = {"name": "box", "file": str(tmp_path / "box.yaml"), "keeper": None,
             "up": {"envs": {"vllm": "/v"}, "timeout_s": 60, "restart": "on-failure", "tritonserver": None,
                    "backend_directory": None},
             "servers": [{"name": "triton", "kind": "triton", "pid": 101, "started": time.time() - 5, "url": "u"},
                         {"name": "gateway", "kind": "gateway", "pid": 102, "started": time.time() - 5, "url": "u"}]}
    (tmp_path / "state.json").write_text(json.dumps(state))
    calls = []
    monkeypatch.setattr(keeper_module, "load_deployment", lambda path: path)
    monkeypatch.setattr(keeper_module, "up", lambda d, **kw: calls.append(kw["only"]))
    monkeypatch.setattr(keeper_module, "members", lambda r: [SimpleNamespace(pid=r["pid"])] if r["pid"] == 101 else [])
    return tmp_path, calls


def test_a_dead_server_is_started_again_alone_at_once_and_counted(box):
    run, calls = box
    keeper = Keeper(run, log=lambda m: None)
    assert keeper.step() and calls == [frozenset({"gateway"})]
    assert json.loads((run / RESTARTS_FILE).read_text())["servers"]["gateway"]["restarts"] == 1


def test_a_server_that_keeps_dying_waits_longer_each_time(box, monkeypatch):
    run, calls = box
    keeper = Keeper(run, log=lambda m: None)
    keeper.step()  # restart 1, at once; the fake up starts nothing, so it is found dead again
    keeper.step()
    assert calls == [frozenset({"gateway"})] and keeper.due["gateway"] - time.time() == pytest.approx(10, abs=1)
    keeper.due["gateway"] = time.time()  # as if 10 s had passed
    keeper.step()
    keeper.step()
    assert len(calls) == 2 and keeper.due["gateway"] - time.time() == pytest.approx(20, abs=1)
    # a server that ran RESET_AFTER_S since its last restart starts again at once
    keeper.counts["gateway"]["last_restart"] -= keeper_module.RESET_AFTER_S
    keeper.due.clear()
    keeper.step()
    assert len(calls) == 3


def test_a_failed_start_is_counted_with_its_cause_and_tried_later(box, monkeypatch):
    run, calls = box

    def fails(d, **kw):
        raise ServerStartError("gateway did not answer ready within 60 s", cause="port taken")

    monkeypatch.setattr(keeper_module, "up", fails)
    keeper = Keeper(run, log=lambda m: None)
    keeper.step()
    counted = json.loads((run / RESTARTS_FILE).read_text())["servers"]["gateway"]
    assert counted["failures"] == 1 and counted["restarts"] == 0 and "did not answer ready" in counted["last_error"]
    assert keeper.due["gateway"] - time.time() == pytest.approx(10, abs=1)


def test_a_busy_box_is_not_counted_and_looked_at_again(box, monkeypatch):
    run, calls = box
    monkeypatch.setattr(keeper_module, "up", lambda d, **kw: (_ for _ in ()).throw(BoxBusy("another serve up")))
    keeper = Keeper(run, log=lambda m: None)
    assert keeper.step() and not (run / RESTARTS_FILE).exists() and keeper.due["gateway"] <= time.time()


def test_the_keeper_ends_with_the_box_or_when_another_is_recorded(box):
    run, calls = box
    state = json.loads((run / "state.json").read_text())
    (run / "state.json").write_text(json.dumps(state | {"keeper": {"pid": 1, "started": 0}}))
    assert not Keeper(run, log=lambda m: None).step() and not calls
    (run / "state.json").unlink()
    assert not Keeper(run, log=lambda m: None).step()


def test_the_gateway_reports_the_keepers_counts_and_nothing_before_its_file(tmp_path):
    from serve.gateway.metrics import render

    body, _ = render(tmp_path / RESTARTS_FILE)
    assert b"# TYPE rtxserve_server_restarts_total counter" in body and b"rtxserve_server_restarts_total{" not in body
    (tmp_path / RESTARTS_FILE).write_text(json.dumps({"servers": {"triton": {"restarts": 2, "failures": 1}}}))
    body = render(tmp_path / RESTARTS_FILE)[0].decode()
    assert 'rtxserve_server_restarts_total{outcome="ok",server="triton"} 2.0' in body
    assert 'rtxserve_server_restarts_total{outcome="failed",server="triton"} 1.0' in body

"""Live headroom (serve/gateway/fleet/headroom.py): a model's confirmed capacity kept with the box it was measured on,
the share of it the last seconds' requests use, a capacity from before the box changed flagged stale, and the admin
routes that record and read it (the real load that moves it: tests/integration/test_headroom.py)."""

import collections
import dataclasses

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from core import metric_names
from serve.gateway import metrics
from serve.gateway.app import create_app
from serve.gateway.backends.base import ModelInfo
from serve.gateway.fleet.headroom import HEADROOM_WINDOW_S, Headroom
from serve.gateway.settings import GatewaySettings

from .fakes import FakeTriton
from .test_auth import bearer, make_key


@dataclasses.dataclass
class _Registry:
    models: dict


def _headroom(tmp_path, models=("clf",)) -> tuple[Headroom, _Registry]:
    registry = _Registry({m: ModelInfo(m, "text-classification", "triton", True, max_batch_size=8) for m in models})
    settings = GatewaySettings(capacity_file=tmp_path / "capacity.json", triton_grpc_url="triton:8001")
    return Headroom(settings, registry), registry


def _gauge(name: str, model: str, stale: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": model, "stale": stale})


def test_the_used_share_is_the_last_seconds_requests_over_the_capacity(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "SEEN", collections.Counter())
    headroom, _ = _headroom(tmp_path)
    headroom.record("clf", 40.0, "e2el:200", "classify, Poisson")
    for second in range(HEADROOM_WINDOW_S + 1):  # 20 requests/s for a window
        headroom.tick(now=1000.0 + second)
        metrics.SEEN["clf"] += 20
    assert headroom.used["clf"] == pytest.approx(0.5)
    assert _gauge(metric_names.CAPACITY_USED, "clf", "false") == pytest.approx(0.5)
    assert _gauge(metric_names.CAPACITY_RPS, "clf", "false") == 40.0
    for second in range(HEADROOM_WINDOW_S + 1, 2 * HEADROOM_WINDOW_S + 2):  # then 60/s: past it
        metrics.SEEN["clf"] += 60
        headroom.tick(now=1000.0 + second)
    assert headroom.used["clf"] == pytest.approx(1.5)


def test_a_capacity_is_kept_for_every_worker_and_flagged_stale_once_the_box_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "SEEN", collections.Counter())
    first, registry = _headroom(tmp_path)
    recorded = first.record("clf", 40.0, "e2el:200", "")
    assert recorded["requests_per_second"] == 40.0 and recorded["stale"] is False
    other, _ = _headroom(tmp_path)  # another worker, or the next start: from the file
    other.tick()
    assert other.status()["clf"]["box"] == recorded["box"] and other.status()["clf"]["stale"] is False
    registry.models["llm"] = ModelInfo("llm", "text-generation", "vllm", True, extra={"max_model_len": 512})
    first.tick()  # another model on the box: the figure no longer says what it holds
    assert first.status()["clf"]["stale"] is True
    assert _gauge(metric_names.CAPACITY_RPS, "clf", "true") == 40.0
    assert _gauge(metric_names.CAPACITY_RPS, "clf", "false") == 0  # the fresh series zeroed, not left as it was


@pytest.fixture
def gateway(tmp_path, capsys):
    path = tmp_path / "keys.json"
    admin, app = (make_key(path, capsys, "--name", "admin", "--admin"),
                  make_key(path, capsys, "--name", "app", "--models", "clf"))
    settings = GatewaySettings(keys_file=path, health_interval_s=60, capacity_file=tmp_path / "capacity.json")
    with TestClient(create_app(settings, [FakeTriton()]), raise_server_exceptions=False) as client:
        yield client, bearer(admin), bearer(app)


def test_an_admin_key_records_a_capacity_and_reads_it_back(gateway, tmp_path):
    client, admin, app = gateway
    body = {"requests_per_second": 152.0, "slo": "e2el:2000", "how": "replay at 0.9x and 1.1x"}
    assert client.put("/admin/capacity/clf", json=body, headers=app).status_code == 403
    assert client.put("/admin/capacity/nope", json=body, headers=admin).status_code == 404
    bad = client.put("/admin/capacity/clf", json={"requests_per_second": 0}, headers=admin)
    assert bad.status_code == 422 and "requests_per_second" in bad.text
    done = client.put("/admin/capacity/clf", json=body, headers=admin)
    assert done.status_code == 200 and done.json()["requests_per_second"] == 152.0 and done.json()["stale"] is False
    listed = client.get("/admin/capacity", headers=admin).json()
    assert listed["models"]["clf"]["slo"] == "e2el:2000" and listed["models"]["clf"]["box"] == listed["box"]
    assert (tmp_path / "capacity.json").is_file()


def test_serve_status_and_a_replay_read_the_headroom_from_metrics_or_nothing():
    import httpx

    from loadtest.server_metrics import capacity_used

    text = (f'# TYPE {metric_names.CAPACITY_RPS} gauge\n{metric_names.CAPACITY_RPS}{{model="clf",stale="true"}} 150.0\n'
            f'# TYPE {metric_names.CAPACITY_USED} gauge\n{metric_names.CAPACITY_USED}{{model="clf",stale="true"}} 0.25\n')
    answers = {"/metrics": httpx.Response(200, text=text), "/other": httpx.Response(404, text="<html>not here</html>"),
               "/garbled": httpx.Response(200, text="{not prometheus")}
    client = httpx.Client(transport=httpx.MockTransport(lambda request: answers[request.url.path]))
    assert capacity_used(client, "http://box/metrics") == {"clf": {"stale": True, "requests_per_second": 150.0,
                                                                    "used_ratio": 0.25}}
    assert capacity_used(client, "http://box/other") == {} and capacity_used(client, "http://box/garbled") == {}

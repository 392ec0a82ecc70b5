"""Live headroom through the real gateway (two workers) and tritonserver, under a real locust load: a capacity recorded
as `rtxserve capacity --record` sends it, then an open-loop load stepped under it, past it and back, read from the
gateway's /metrics as `serve status` reads it (summed over the workers)."""

import contextlib
import io
import threading
import time

import httpx
import pytest

from loadtest.capacity import CapacityResult
from loadtest.cli import record_capacity
from loadtest.report.report import load_samples
from loadtest.runner import LoadSpec, run, scenario_options
from loadtest.server_metrics import capacity_used
from serve.gateway.access.keys_cli import main as keys_main
from serve.stack import start_gateway

from .conftest import MODEL

CAPACITY = 20.0  # requests/s, as if `rtxserve capacity` had confirmed it
STEPS = ((14, 8.0), (14, 40.0), (14, 8.0))  # seconds, requests/s: under it, past it, back under


@pytest.fixture(scope="module")
def gateway(stack, tmp_path_factory):
    work = tmp_path_factory.mktemp("headroom")
    secrets = {}
    for args in (["--name", "ops", "--admin"], ["--name", "app", "--models", MODEL]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            assert keys_main(["--keys", str(work / "keys.json"), "create", *args]) == 0
        secrets[args[1]] = out.getvalue().strip()
    server, url = start_gateway(stack.triton_grpc_url, work, workers=2, extra_env={
        "RTXSERVE_KEYS_FILE": str(work / "keys.json"), "RTXSERVE_CAPACITY_FILE": str(work / "capacity.json")})
    yield url, secrets
    server.stop()


def _confirmed(tmp_path) -> CapacityResult:
    """What `rtxserve capacity` returns once it confirmed CAPACITY (its 0.9x run held)."""
    return CapacityResult([{"phase": "confirm-0.9x", "holds": True}], CAPACITY, None, "held 20 requests/s", tmp_path)


def test_the_used_share_follows_a_load_stepped_past_a_recorded_capacity_and_back(gateway, tmp_path):
    url, secrets = gateway
    spec = LoadSpec(url, scenario_options(model=MODEL, api_key=secrets["ops"], arrival="poisson",
                                          stages=",".join(f"{s}:{r:g}" for s, r in STEPS)), warmup_s=0)
    assert "recorded: " in record_capacity(spec, _confirmed(tmp_path))
    with httpx.Client(timeout=10) as client:
        assert capacity_used(client, f"{url}/metrics")[MODEL] == {"stale": False, "requests_per_second": CAPACITY,
                                                                  "used_ratio": 0.0}
        readings, stop = [], threading.Event()

        def read() -> None:
            while not stop.is_set():
                readings.append((time.time(), capacity_used(client, f"{url}/metrics")[MODEL]["used_ratio"]))
                time.sleep(0.5)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            result = run(spec, tmp_path / "load", log=lambda m: None)
        finally:
            stop.set()
            reader.join()
    assert result.summary.errors == 0, result.summary.error_reasons
    # the last 3 s of each step, from the load's first request: its window (the last 10 s) holds that step's alone
    started = load_samples(result.out_dir / "samples.csv").start.min()
    ends = [sum(s for s, _ in STEPS[:i + 1]) for i in range(len(STEPS))]
    step = [[used for t, used in readings if end - 3 <= t - started <= end] for end in ends]
    print({rate: [round(u, 2) for u in used] for (_, rate), used in zip(STEPS, step)})
    assert all(step) and max(step[0]) < 0.75 and min(step[1]) > 1.3 and max(step[2]) < 0.75, step


def test_a_replay_says_how_close_it_ran_to_the_recorded_capacity(gateway, tmp_path):
    """40 classify requests over 3.9 s of a trace the gateway could have written, replayed against a recorded
    capacity of 20 requests/s: about half of it, in the report's recorded-vs-replayed notes."""
    import json

    url, secrets = gateway
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": 1000 + i * 0.1, "route": "/v1/classify", "model": MODEL, "items": 1,
                                         "chars": 20}) + "\n" for i in range(40)))
    spec = LoadSpec(url, scenario_options(scenario="replay", arrival="trace", trace=str(trace),
                                          api_key=secrets["ops"]), warmup_s=0)
    record_capacity(spec, _confirmed(tmp_path))
    result = run(spec, tmp_path / "replay", log=lambda m: None)
    capacity = result.summary.replay["capacity"][MODEL]
    assert capacity == {"replayed_rps": round(40 / 3.9, 3), "capacity_rps": CAPACITY,
                        "share": round(40 / 3.9 / CAPACITY, 3), "stale": False}
    assert f"{MODEL}: replayed at {round(40 / 3.9, 3):g} requests/s, 51% of the box's confirmed capacity" in \
        result.report.read_text()

"""Real locust runs through the real gateway and tritonserver: every encoder scenario in closed and open
loop, a 2-worker run, stages, a sweep, the server-side view, and runs refused before any load."""

import base64
import csv
import json
import math
from collections import Counter

import httpx
import numpy as np
import pytest

from loadtest.report.report import load_samples
from loadtest.runner import LoadSpec, run, scenario_options
from loadtest.sweep import sweep

from .conftest import EMBEDDER, MODEL, TAGGER, VISION, YOLO

quiet = dict(log=lambda m: None)


def _locust_count(folder) -> int:
    """Requests in locust's own final summary (its stats CSV is rewritten each second and lags the end)."""
    line = next(l for l in (folder / "locust.log").read_text().splitlines() if l.strip().startswith("Aggregated"))
    return int(line.split()[1])


def test_a_run_reports_percentiles_plots_and_the_servers_side_and_loses_no_request(stack, tmp_path):
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL), users=4, duration_s=8, warmup_s=1,
                    slo="e2el:1000", scrape=[stack.triton_metrics_url])
    result = run(spec, tmp_path / "report", **quiet)
    s = result.summary
    assert s.requests > 0 and s.errors == 0 and s.qps > 0  # how many is the box's speed: benchmarks measure it
    assert all(math.isfinite(v) and v > 0 for v in s.latency_ms.values())
    assert s.latency_ms["p50"] <= s.latency_ms["p90"] <= s.latency_ms["p99"] <= s.latency_ms["max"]
    assert s.goodput["good_requests"] <= s.requests and s.goodput["slo_ms"] == {"e2el": 1000}
    folder = tmp_path / "report"
    assert len(load_samples(folder / "samples.csv").end) == _locust_count(folder)  # every request has its row
    assert json.loads((folder / "report.json").read_text())["qps"] == s.qps
    scraped = (folder / "server_metrics.csv").read_text()
    assert "nv_inference_queue_duration_us" in scraped and "rtxserve_request_duration_seconds_sum" in scraped
    html = (folder / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "Where the time goes" in html  # latency + server plots
    assert f"| {MODEL}_model | " in result.report.read_text()  # Triton's own figures for the model itself


@pytest.mark.parametrize("arrival", ["closed", "poisson"])
@pytest.mark.parametrize("scenario, model", [("ner", TAGGER), ("embeddings", EMBEDDER), ("image", VISION),
                                             ("detect", YOLO)])
def test_every_encoder_api_answers_under_closed_and_open_loop_load(stack, yolo_run, tmp_path, scenario, model, arrival):
    # the detector is sent the YOLO fixture's validation images, in each of which its build checked it finds a rectangle
    dataset = yolo_run.parent / "data" / "images" / "val"
    options = scenario_options(scenario=scenario, model=model, batch=2, arrival=arrival, rate=10.0,
                               dataset=str(dataset) if scenario == "detect" else "")
    # no warm-up: on a busy machine locust may send its first request late in a 3 s run; every request is counted
    s = run(LoadSpec(stack.gateway_url, options, users=2, duration_s=3, warmup_s=0), tmp_path / "report", **quiet).summary
    assert s.requests > 0 and s.errors == 0, s.error_kinds
    assert bool(s.late_arrivals) == (arrival == "poisson")  # open-loop requests carry their lateness
    if scenario == "detect":  # images/s, per-image latency and objects per image: between the fewest and most it finds
        found = [len(d["detections"]) for d in httpx.post(f"{stack.gateway_url}/v1/detect", timeout=60, json={
            "model": model, "input": [{"image": base64.b64encode(p.read_bytes()).decode()}
                                      for p in sorted(dataset.glob("*.png"))]}).json()["data"]]
        assert min(found) > 0 and s.images["images"] == 2 * s.requests, (found, s.images)
        assert min(found) <= s.images["detections_per_image"] <= max(found), (found, s.images)
        assert "objects per image" in (tmp_path / "report" / "report.md").read_text()


def test_open_loop_poisson_arrivals_hold_the_offered_rate(stack, tmp_path):
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL, arrival="poisson", rate=20), duration_s=10,
                    warmup_s=2)
    result = run(spec, tmp_path / "report", **quiet)
    s = result.summary
    # the offered load, from the requests' start times: Poisson, 160 arrivals in 8 s, sd 1.6/s: 20 ± 6 is 3.8 sigma
    assert s.errors == 0 and 14 <= s.sent_rps <= 26, s.sent_rps
    # every request carries its lateness (how many were late is the generator's speed on this box: not asserted);
    # none of it was the in-flight cap's: 256 slots are never all taken by 20 requests a second that each end
    assert s.late_arrivals["of"] == s.requests and 0 <= s.late_arrivals["requests"] <= s.requests
    assert s.late_arrivals["capped"] == 0
    samples = load_samples(tmp_path / "report" / "samples.csv")
    gaps = np.diff(np.sort(samples.start))
    assert gaps.std() / gaps.mean() > 0.6  # exponential gaps (CV 1), not a metronome (CV 0)


def _served(gateway_url: str, route: str = "/v1/classify") -> float:
    """Requests the gateway answered on `route`, from its own counter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gateway_url}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "rtxserve_requests_total" and sample.labels.get("route") == route)


def test_two_workers_under_one_master_send_to_one_report_and_lose_no_sample(stack, tmp_path):
    before = _served(stack.gateway_url)
    # near-constant gaps (gamma, burstiness 100), so that each worker's count is its share of the rate, not noise
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL, arrival="gamma", burstiness=100, rate=30),
                    duration_s=8, warmup_s=1, workers=2)
    result = run(spec, tmp_path / "report", **quiet)
    s = result.summary
    assert s.errors == 0 and s.settings["load generator"]["processes"] == 3  # the master and 2 workers
    # every request the gateway answered has its row, the workers' last batches included
    assert len(load_samples(tmp_path / "report" / "samples.csv").end) == _served(stack.gateway_url) - before
    with open(tmp_path / "report" / "samples.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sent = Counter(r["process"] for r in rows)
    assert len(sent) == 2 and "main" not in sent, sent  # the workers sent every request, the master none
    # each sent its half of 30/s (within 15 %) over its own schedule: a worker that a busy box started late (one in CI
    # sent 90 of 120 in 8 s) starts its schedule late, and keeps its rate
    for process in sent:
        starts = np.sort([float(r["end"]) - float(r["latency_ms"]) / 1000 for r in rows if r["process"] == process])
        rate = (len(starts) - 1) / (starts[-1] - starts[0])
        assert abs(rate - 15) <= 15 * 0.15, (process, rate)


def test_closed_loop_stages_ramp_the_users(stack, tmp_path):
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL, stages="4:1,4:4"), warmup_s=0.5)
    run(spec, tmp_path / "report", **quiet)
    samples = load_samples(tmp_path / "report" / "samples.csv")
    t0 = samples.start.min()
    start, end = samples.start - t0, samples.end - t0

    def most_in_flight(a: float, b: float) -> int:  # requests in flight at once, at any request's start in [a, b)
        return max(((start <= s) & (end > s)).sum() for s in start[(start >= a) & (start < b)])

    # closed loop: one user never has two requests in flight; four users do (counted, not timed)
    assert most_in_flight(0, 3.5) == 1 and most_in_flight(5, 8) > 1


def test_errors_are_counted_not_hidden(stack, tmp_path):
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL, batch=300), users=2, duration_s=3, warmup_s=0.5)
    result = run(spec, tmp_path / "report", **quiet)  # over the gateway's 256 inputs per request: each is a 400
    assert result.summary.errors == result.summary.requests > 0
    assert result.summary.error_kinds == {"HTTP 400": result.summary.errors}
    # with the server's own reason, by status and API, never a bare count
    ((key, [[why, n]]),) = result.summary.error_reasons.items()
    assert key == "HTTP 400 classify" and n == result.summary.errors and "256" in why, why
    assert f"- HTTP 400 classify: {why} ({n})" in result.report.read_text()


def test_a_sweep_finds_the_highest_rate_within_the_slo(stack, tmp_path):
    # an SLO only a hang misses: whether 20 req/s holds a tight one is this box's speed, which benchmarks measure
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL, arrival="poisson"), duration_s=6, warmup_s=1,
                    slo="e2el:30000")
    result = sweep(spec, tmp_path / "sweep", steps="5,10,20", **quiet)
    assert [s["load"] for s in result.steps] == [5, 10, 20] and all(s["holds"] for s in result.steps), result.notes
    assert result.verdict["max_load_within_slo"] == 20 and result.verdict["max_goodput_rps"] > 0
    assert "max load within the SLO: 20 req/s" in result.headline
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 10_000 and (tmp_path / "sweep" / "sweep.html").exists()
    assert (tmp_path / "sweep" / "step-03-20" / "report.md").exists()


def test_a_step_whose_arrivals_wait_for_the_in_flight_cap_ends_the_sweep(stack, tmp_path):
    # one request at a time against 400 arrivals a second: the cap, not the server's answers, holds them back
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL, arrival="poisson", max_in_flight=1), duration_s=3,
                    warmup_s=0.5)
    result = sweep(spec, tmp_path / "sweep", steps="400,800", **quiet)
    assert len(result.steps) == 1 and "of the arrivals waited for the in-flight cap" in result.notes[0], result.notes
    late = json.loads((tmp_path / "sweep" / result.steps[0]["report"]).with_name("report.json").read_text())
    assert late["late_arrivals"]["capped"] > late["late_arrivals"]["of"] / 2, late["late_arrivals"]


def test_a_sweep_whose_slo_no_step_meets_says_so(stack, tmp_path):
    spec = LoadSpec(stack.gateway_url, scenario_options(model=MODEL), duration_s=3, warmup_s=0.5, slo="e2el:0.01")
    result = sweep(spec, tmp_path / "sweep", steps="1,2", **quiet)
    assert result.verdict["max_load_within_slo"] is None and result.headline.startswith("no step met the SLO")


def test_an_unknown_model_or_nothing_listening_fails_at_once_without_a_report(stack, tmp_path, capsys, monkeypatch):
    """Refused before locust starts (not after its 30 s run): a start of locust fails the test."""
    import loadtest.runner
    from loadtest.cli import main
    from serve.launcher import free_port

    monkeypatch.setattr(loadtest.runner.subprocess, "Popen", lambda *a, **k: pytest.fail("locust was started"))
    for host, model, message in ((stack.gateway_url, "no_such_model", "model no_such_model is not served at"),
                                 (f"http://127.0.0.1:{free_port()}", MODEL, "nothing answers at http://127.0.0.1:")):
        code = main(["run", "--host", host, "--model", model, "--duration", "30", "--out", str(tmp_path / "report")])
        assert code == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "report").exists()

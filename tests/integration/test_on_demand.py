"""On-demand Triton entries through the real gateway and a real tritonserver in explicit model-control mode: more
classifier fine-tunes than the room holds, loaded on their first request through Triton's repository API, the least
recently used unloaded to make room, idle ones unloaded, a broken one refused by name while the others answer, and a
real locust load spread over all of them with Zipf popularity."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from export.encoders.encoder import export_text_classification
from export.triton.entry import EntryOptions
from loadtest.runner import LoadSpec, run, scenario_options
from deploy.monitoring import queried_metrics
from loadtest.server_metrics import load, swap_events
from serve.stack import start_gateway, start_triton

from . import until

ALWAYS = "reviews_en"
SWAPPED = ("reviews_de", "reviews_fr", "reviews_es")  # room for two of them
IDLE = "reviews_it"  # unloaded after 2 s without a request
FIRST = "reviews_pt"  # asked for by one test only: its first load is that test's, whatever ran before
BROKEN = "reviews_broken"  # its ONNX file is garbage: its load fails
TEXT = "a wonderful, delightful film"


@pytest.fixture(scope="module")
def box(classifier_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("on-demand")
    for name in (ALWAYS, *SWAPPED, IDLE, FIRST, BROKEN):
        export_text_classification(classifier_checkpoint, EntryOptions(name=name), work / "repo")
    for onnx in (work / "repo" / f"{BROKEN}_model" / "1").glob("*.onnx"):
        onnx.write_bytes(b"not an ONNX graph")
    shutil.rmtree(work / "repo" / f"{BROKEN}_model" / "1" / "model.onnx_data", ignore_errors=True)
    triton, opts = start_triton(work / "repo", work / "logs", load_models=[ALWAYS])
    on_demand = {n: {"task": "text-classification", "gib": 1.0, "idle_unload_s": 2.0 if n == IDLE else None}
                 for n in (*SWAPPED, IDLE, FIRST, BROKEN)}
    try:
        gateway, url = start_gateway(f"127.0.0.1:{opts.grpc_port}", work / "logs", extra_env={
            "RTXSERVE_ON_DEMAND": json.dumps(on_demand), "RTXSERVE_SWAP_ROOM_GIB": "2",
            "RTXSERVE_LOAD_RETRY_S": "30", "RTXSERVE_HEALTH_INTERVAL_S": "0.5"})
    except BaseException:
        triton.stop()
        raise
    yield url, f"http://127.0.0.1:{opts.http_port}"
    gateway.stop()
    triton.stop()


def loaded(triton_url: str) -> set[str]:
    """The entries Triton has loaded, from its own repository index."""
    index = httpx.post(f"{triton_url}/v2/repository/index", json={}, timeout=10).json()
    return {m["name"] for m in index if m.get("state") == "READY" and m["name"].startswith("reviews_")
            and not m["name"].endswith(("_model", "_tokenizer", "_postprocess"))}


def counter(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def classify(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/classify", json={"model": model, "input": TEXT}, timeout=120)


def test_only_the_always_resident_entry_is_loaded_at_start(box):
    url, triton = box
    now = loaded(triton)  # an earlier test may have loaded some on-demand entries: each one the gateway counts
    listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
    assert ALWAYS in now and BROKEN not in now
    assert now - {ALWAYS} == {n for n, m in listed.items() if m.get("on_demand", {}).get("state") == "loaded"}
    assert listed[BROKEN]["on_demand"]["state"] == "unloaded" and "on_demand" not in listed[ALWAYS]


def test_ten_concurrent_first_requests_cause_one_load_and_answer_as_the_resident_copy(box):
    url, triton = box
    model = FIRST
    assert model not in loaded(triton)
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: classify(url, model), range(10)))
    assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
    assert counter(url, "rtxserve_model_loads_total", model=model, outcome="loaded") == 1
    assert counter(url, "rtxserve_load_waits_total", model=model, outcome="served") == 10
    assert model in loaded(triton)
    reference = classify(url, ALWAYS).json()["data"][0]  # the same weights, loaded at start
    assert all(a.json()["data"][0]["label"] == reference["label"] for a in answers)
    assert answers[0].json()["data"][0]["score"] == pytest.approx(reference["score"], abs=1e-5)


def test_the_least_recently_used_entry_is_unloaded_to_make_room(box):
    url, triton = box
    de, fr, es = SWAPPED
    before = counter(url, "rtxserve_model_unloads_total", model=fr, reason="room")
    for model in (fr, de, es):  # room for two: es takes fr's place, de having been asked for after it
        answer = classify(url, model)
        assert answer.status_code == 200, answer.text
    assert {de, es} <= loaded(triton) and fr not in loaded(triton)
    assert counter(url, "rtxserve_model_unloads_total", model=fr, reason="room") == before + 1


def test_an_idle_entry_is_unloaded_after_its_idle_time(box):
    url, triton = box
    before = counter(url, "rtxserve_model_unloads_total", model=IDLE, reason="idle")
    assert classify(url, IDLE).status_code == 200 and IDLE in loaded(triton)
    until(lambda: IDLE not in loaded(triton), f"{IDLE} unloaded", limit_s=30)
    # counted once the gateway has seen Triton's repository without it (its refresh after the unload returned)
    until(lambda: counter(url, "rtxserve_model_unloads_total", model=IDLE, reason="idle") == before + 1,
          "the idle unload counted", limit_s=10)


def test_a_broken_entry_is_refused_by_name_and_the_others_answer(box):
    url, _ = box
    refused = classify(url, BROKEN)
    assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
    assert f"model '{BROKEN}' could not be loaded" in refused.json()["error"]["message"]
    again = classify(url, BROKEN)  # within the backoff: refused at once, no second try
    assert again.status_code == 503 and "next try" in again.json()["error"]["message"]
    assert counter(url, "rtxserve_model_loads_total", model=BROKEN, outcome="failed") == 1
    assert classify(url, ALWAYS).status_code == 200 and classify(url, SWAPPED[1]).status_code == 200


def test_a_zipf_load_over_more_entries_than_fit_gets_answers_or_the_documented_503(box, tmp_path):
    url, _ = box
    swaps = counter(url, "rtxserve_model_unloads_total")
    models = ",".join((*SWAPPED, IDLE))
    spec = LoadSpec(url, scenario_options(model=models, zipf=1.0), users=4, duration_s=8, warmup_s=0,
                    scrape=[f"{url}/metrics"])
    s = run(spec, tmp_path / "report", log=lambda m: None).summary
    assert s.requests > 0 and set(s.error_kinds) <= {"HTTP 503"}, s.error_kinds  # 200 or 503 with Retry-After
    assert set(s.by_model) <= set(models.split(","))  # the report splits the figures by model
    unloads = counter(url, "rtxserve_model_unloads_total") - swaps
    assert unloads > 0  # four entries, room for two: they swapped
    # the report marks each swap the gateway counted on its latency-over-time plot
    events = swap_events(load(tmp_path / "report" / "server_metrics.csv"), 0.0)
    # (the run's scrapes see those during it: reviews_it's idle unload may come after the last)
    assert 0 < sum(e.what == "unload" for e in events) <= unloads and {e.model for e in events} <= set(models.split(","))


def test_the_on_demand_dashboard_panels_query_what_this_gateway_exposes(box):
    """The gateway dashboard of a box with on-demand models: each metric its panels query is one this gateway
    serves, once it has loaded and unloaded (the other panels are checked in test_deploy_render)."""
    from deploy.monitoring import dashboards
    from deploy.load import parse_deployment

    url, _ = box
    for model in (*SWAPPED, SWAPPED[0]):  # three entries through a room for two: loads, an unload, waits
        assert classify(url, model).status_code == 200
    d = parse_deployment({"name": "swaps", "models": [
        {"name": "de", "kind": "encoder", "path": "repo/de", "resident": "on-demand"}]})
    queried = queried_metrics(dashboards(d)["rtxserve-gateway.json"])
    swapping = {n for n in queried if "model_" in n or "load_waits" in n}
    assert len(swapping) == 5  # resident, loads, unloads, load seconds, waits
    samples = [s.name for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
               for s in f.samples]
    exposed = {n.removesuffix("_total").removesuffix("_bucket") for n in samples}
    assert sorted(n for n in swapping if n.removesuffix("_total") not in exposed) == []


def test_four_gateway_workers_under_a_load_load_each_entry_once_per_need_and_never_under_a_request(
        classifier_checkpoint, tmp_path):
    """`workers: 4` over on-demand entries (one of them deciding for all, fleet/decider.py), a real locust load with
    Zipf popularity over more entries than the room holds: every answer is 200 or the documented 503 (never an entry
    gone under a request), and Triton's own log shows no entry loaded twice without an unload between (one load per
    need, whichever worker's request needed it), nor more of them loaded at once than the room holds."""
    import re

    for name in (ALWAYS, *SWAPPED, IDLE):
        export_text_classification(classifier_checkpoint, EntryOptions(name=name), tmp_path / "repo")
    triton, opts = start_triton(tmp_path / "repo", tmp_path / "logs", load_models=[ALWAYS])
    on_demand = {n: {"task": "text-classification", "gib": 1.0, "idle_unload_s": 1.0 if n == IDLE else None}
                 for n in (*SWAPPED, IDLE)}
    try:
        gateway, url = start_gateway(f"127.0.0.1:{opts.grpc_port}", tmp_path / "logs", workers=4, extra_env={
            "RTXSERVE_ON_DEMAND": json.dumps(on_demand), "RTXSERVE_SWAP_ROOM_GIB": "2",
            "RTXSERVE_HEALTH_INTERVAL_S": "0.5"})
        log = tmp_path / "logs" / "tritonserver.log"
        start = len(log.read_text())  # what Triton loaded and unloaded before the load, at its own start
        try:
            spec = LoadSpec(url, scenario_options(model=",".join((*SWAPPED, IDLE)), zipf=1.0), users=8, duration_s=12,
                            warmup_s=0)
            s = run(spec, tmp_path / "report", log=lambda m: None).summary
            unloads = counter(url, "rtxserve_model_unloads_total")
            deciders = counter(url, "rtxserve_residency_takeovers_total")
        finally:
            gateway.stop()
    finally:
        triton.stop()
    assert s.requests > 0 and set(s.error_kinds) <= {"HTTP 503"}, s.error_kinds
    assert unloads > 0  # four entries, room for two: they swapped
    pattern = r"successfully (loaded|unloaded) '(reviews_[a-z]+)'"
    loaded_now = {name for what, name in re.findall(pattern, log.read_text()[:start]) if what == "loaded"} - {
        name for what, name in re.findall(pattern, log.read_text()[:start]) if what == "unloaded"}
    assert loaded_now == {ALWAYS}
    events = re.findall(pattern, log.read_text()[start:])
    for what, name in events:
        if what == "loaded":
            assert name not in loaded_now, f"{name} loaded twice without an unload between: {events}"
            loaded_now.add(name)
            assert len(loaded_now - {ALWAYS}) <= 2, f"the room for two over-committed: {loaded_now}; {events}"
        else:
            loaded_now.discard(name)
    assert sum(what == "loaded" for what, _ in events) > len(SWAPPED)  # reloads after unloads: the test saw swaps
    assert deciders == 1  # one worker decided throughout

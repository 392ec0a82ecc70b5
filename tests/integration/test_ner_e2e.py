"""The fixture NER tagger, exported, served by the real tritonserver behind the gateway: POST /v1/ner gives
the same entities (types, character offsets, scores) as transformers' pipeline on the same texts, for
every aggregation strategy, several texts per request (so Triton batches them together)."""

import httpx
import numpy as np
import pytest

from fixture_models.text import NER_PROBES

from .conftest import TAGGER

TEXTS = [
    *NER_PROBES,  # tagged with a margin, checked by the fixture's build
    "Yesterday Zbigniew met Anna in Oslo! Ünïcödé 👍 test",
    "  leading spaces and maria gonzalez  ",
    " ".join(["bob works for globex in berlin"] * 30),  # over the 128-token limit
]


@pytest.fixture(scope="module")
def reference(ner_checkpoint):
    from transformers import pipeline

    return lambda strategy: pipeline("token-classification", model=str(ner_checkpoint),
                                     aggregation_strategy=strategy)(TEXTS)


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_served_entities_match_the_transformers_pipeline(stack, reference, strategy):
    r = httpx.post(f"{stack.gateway_url}/v1/ner", json={"model": TAGGER, "input": TEXTS, "aggregation": strategy},
                   timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["aggregation"] == strategy and len(body["data"]) == len(TEXTS)
    key = "entity" if strategy == "none" else "entity_group"
    for text, served, theirs in zip(TEXTS, body["data"], reference(strategy)):
        assert [(e["entity"], e["start"], e["end"]) for e in served["entities"]] == \
            [(e[key], e["start"], e["end"]) for e in theirs], text
        assert np.allclose([e["score"] for e in served["entities"]], [float(e["score"]) for e in theirs], atol=1e-4)
        assert all(e["word"] == text[e["start"]:e["end"]] for e in served["entities"])
    assert [d["truncated"] for d in body["data"]] == [False, False, False, False, True]
    # the comparison has entities to compare: each probe's, whole or in pieces
    assert sum(len(d["entities"]) for d in body["data"]) >= sum(map(len, NER_PROBES.values()))


def test_the_exported_default_applies_when_the_request_names_none(stack):
    r = httpx.post(f"{stack.gateway_url}/v1/ner", json={"model": TAGGER, "input": TEXTS[0]}, timeout=30)
    assert r.status_code == 200 and r.json()["aggregation"] == "first"
    assert {e["word"]: e["entity"] for e in r.json()["data"][0]["entities"]} == NER_PROBES[TEXTS[0]]


def test_ner_model_is_listed_with_its_task(stack):
    models = {m["id"]: m["task"] for m in httpx.get(f"{stack.gateway_url}/v1/models").json()["data"]}
    assert models[TAGGER] == "token-classification"

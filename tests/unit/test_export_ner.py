"""token-classification export: entity spans computed by export/entities.py (what the Triton postprocess
runs) against transformers' pipeline on the fixture NER tagger, for every aggregation strategy."""

import json

import numpy as np
import pytest
import torch

from export.encoders.encoder import EncoderOptions, export_encoder
from export.triton.python_models.ner_postprocess.entities import STRATEGIES, Token, entities
from export.exceptions import ExportError
from export.encoders.task_specs import tokenizer_traits
from export.triton.entry import EntryOptions
from fixture_models.text import NER_PROBES

TEXTS = [
    *NER_PROBES,  # tagged with a margin, checked by the fixture's build
    "Yesterday Zbigniew met Anna in Oslo! Ünïcödé 👍 test",
    "  leading spaces and maria gonzalez  ",
    " ".join(["bob works for globex in berlin"] * 30),  # longer than the 128-token limit: truncated
]


@pytest.fixture(scope="module")
def tagger(ner_checkpoint):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ner_checkpoint)
    model = AutoModelForTokenClassification.from_pretrained(ner_checkpoint).eval()
    return tokenizer, model


def _ours(tokenizer, model, text, strategy):
    word_aware, unk_id = tokenizer_traits(tokenizer.backend_tokenizer.to_str())
    enc = tokenizer(text, truncation=True, max_length=128, return_offsets_mapping=True,
                    return_special_tokens_mask=True)
    tokens = [Token(i, t, s, e, bool(m)) for i, t, (s, e), m in
              zip(enc["input_ids"], tokenizer.convert_ids_to_tokens(enc["input_ids"]), enc["offset_mapping"],
                  enc["special_tokens_mask"])]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([enc["input_ids"]])).logits[0].numpy()
    return entities(text, tokens, logits, [model.config.id2label[i] for i in range(model.config.num_labels)],
                    strategy, word_aware=word_aware, unk_id=unk_id)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_entities_match_the_transformers_pipeline(tagger, strategy):
    from transformers import pipeline

    tokenizer, model = tagger
    reference = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=strategy)
    key = "entity" if strategy == "none" else "entity_group"
    for text in TEXTS:
        ours = _ours(tokenizer, model, text, strategy)
        theirs = reference(text)
        assert [(e[key], e["start"], e["end"]) for e in ours] == [(e[key], e["start"], e["end"]) for e in theirs], text
        assert np.allclose([e["score"] for e in ours], [float(e["score"]) for e in theirs], atol=1e-6)
        assert all(e["word"] == text[e["start"]:e["end"]] for e in ours)
        if text in NER_PROBES and strategy in ("first", "average", "max"):  # whole words: the probe's entities
            assert {e["word"]: e["entity_group"] for e in ours} == NER_PROBES[text]


def test_word_strategies_merge_subwords_into_whole_words(tagger):
    tokenizer, model = tagger
    spans = {e["word"]: e["entity_group"] for e in _ours(tokenizer, model, TEXTS[0], "first")}
    assert spans == NER_PROBES[TEXTS[0]]


def test_unknown_strategy_is_refused(tagger):
    tokenizer, model = tagger
    with pytest.raises(ValueError, match="unknown aggregation 'best'"):
        _ours(tokenizer, model, "anna", "best")


def test_export_writes_a_token_classification_entry(ner_checkpoint, tmp_path):
    repo = tmp_path / "repo"
    result = export_encoder(ner_checkpoint, "token-classification", EntryOptions("ner"), repo, EncoderOptions(aggregation="average"))
    assert result.parity["passed"]
    logits = result.parity["outputs"]["logits"]
    assert len(logits["shape"]) == 3 and logits["max_abs_diff"] < 1e-4 and logits["top1_agreement"] == 1.0
    ensemble = (repo / "ner" / "config.pbtxt").read_text()
    assert '"token-classification"' in ensemble and "ENTITIES" in ensemble and '"average"' in ensemble
    post = repo / "ner_postprocess"
    assert {p.name for p in (post / "1").iterdir()} == {"model.py", "entities.py", "tokenizer.json"}
    assert '"word_aware"' in (post / "config.pbtxt").read_text()
    metadata = json.loads((repo / "ner" / "rtxserve.json").read_text())
    assert metadata["task"] == "token-classification" and metadata["labels"][0] == "O"


def test_unknown_aggregation_fails_before_any_work(ner_checkpoint, tmp_path):
    with pytest.raises(ExportError, match="unknown --aggregation 'best'"):
        export_encoder(ner_checkpoint, "token-classification", EntryOptions("ner"), tmp_path / "repo", EncoderOptions(aggregation="best"))
    assert not (tmp_path / "repo").exists()


def test_a_classifier_is_not_a_token_classifier(classifier_checkpoint, tmp_path):
    with pytest.raises(ExportError, match="needs a \\*ForTokenClassification model"):
        export_encoder(classifier_checkpoint, "token-classification", EntryOptions("ner"), tmp_path / "repo")

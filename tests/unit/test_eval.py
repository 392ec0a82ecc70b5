"""`rtxserve eval`'s comparisons, each family's (loadtest/eval/), on answers written here: what agrees, what drifts,
what a near tie is; the user's eval sets read or refused by line; and the percentiles `rtxserve promote` reads off the
gateway's histograms."""

import json
import math

import numpy as np
import pytest

from core.reference import Item, ReferenceError, ReferenceSet, read_eval_set
from loadtest.eval.families import Classification, Detections, Entities
from loadtest.eval.generation import Generation, Speech
from rtxserve.promote.figures import quantile

LABELS = ["neg", "neu", "pos"]


def ref(task, items, **fields) -> ReferenceSet:
    return ReferenceSet(task=task, framework="test", items=items, **fields)


def softmax(z):
    e = np.exp(np.asarray(z) - max(z))
    return e / e.sum()


def classified(label, probs):
    return {"data": [{"label": label, "score": max(probs), "scores": dict(zip(LABELS, map(float, probs)))}]}


def test_a_classifiers_logits_are_compared_centred_from_the_served_probabilities():
    logits = [2.0, -1.0, 0.5]
    item = Item(input="x", expect={"label": "neg", "logits": logits}, gold="neg")
    r = ref("text-classification", [item], labels=LABELS)
    same = Classification().compare(item, classified("neg", softmax([z + 7 for z in logits])), r)  # any shift: same
    assert same.agrees and same.drift < 1e-6 and same.gold == {"served": True, "framework": True}
    moved = Classification().compare(item, classified("neg", softmax([2.0, -1.0, 0.6])), r)
    assert moved.agrees and moved.drift == pytest.approx(0.1 * 2 / 3, abs=1e-6)  # 0.1 on one, centred
    shuffled = Classification().compare(item, classified("pos", softmax(logits)), r)
    assert not shuffled.agrees


def test_a_multi_label_classifiers_logits_are_each_sigmoids_own():
    logits = [1.5, -2.0, 0.0]
    item = Item(input="x", expect={"label": "neg", "logits": logits})
    r = ref("text-classification", [item], labels=LABELS, settings={"multi_label": True})
    sig = [1 / (1 + math.exp(-z)) for z in logits]
    assert Classification().compare(item, classified("neg", sig), r).drift < 1e-6


def test_the_default_bounds_are_tight_for_an_exact_artifact_and_what_export_measured_for_a_lossy_one():
    item = Item(input="x", expect={"label": "neg", "logits": [0, 0, 0]})
    exact = Classification().default_limits(ref("text-classification", [item], variant="optimized"))
    lossy = Classification().default_limits(ref("text-classification", [item], variant="int8",
                                                drift={"max_abs_diff": 0.2}))
    assert exact == {"agreement": 1.0, "drift": 1e-3} and lossy == {"agreement": 0.9, "drift": 0.4}


def test_entities_agree_on_type_and_span_and_drift_by_score():
    want = [{"entity": "PER", "score": 0.9, "start": 0, "end": 3, "word": "Bob"}]
    item = Item(input="Bob", expect={"entities": want})
    r = ref("token-classification", [item], settings={"aggregation": "first"})
    close = Entities().compare(item, {"data": [{"entities": [dict(want[0], score=0.85)]}]}, r)
    assert close.agrees and close.drift == pytest.approx(0.05)
    other = Entities().compare(item, {"data": [{"entities": [dict(want[0], entity="LOC")]}]}, r)
    assert not other.agrees and math.isinf(other.drift)


def test_detections_are_matched_by_class_and_overlap_and_those_near_the_cut_may_fall_either_side():
    want = [[0, 0, 10, 10, 0.9, 1], [20, 20, 30, 30, 0.505, 0]]  # the second just over the 0.5 cut
    item = Item(input={"image": ""}, expect={"detections": want})
    r = ref("object-detection", [item], settings={"conf": 0.5})
    served = lambda rows: {"data": [{"detections": [{"box": row[:4], "score": row[4], "class_id": row[5]}  # noqa: E731
                                                    for row in rows]}]}
    assert Detections().compare(item, served([[1, 0, 10, 10, 0.89, 1]]), r).agrees  # IoU 0.9; the near-cut one gone
    assert not Detections().compare(item, served([[0, 0, 10, 10, 0.9, 0]]), r).agrees  # another class
    assert not Detections().compare(item, served([[0, 0, 10, 10, 0.9, 1], [50, 50, 60, 60, 0.8, 1]]), r).agrees


def chat(tokens):
    """A chat answer with logprobs as vLLM writes them with return_tokens_as_token_ids: (token, logprob, {top})."""
    return {"choices": [{"message": {"content": "text"}, "logprobs": {"content": [
        {"token": f"token_id:{t}", "logprob": lp, "top_logprobs": [{"token": f"token_id:{k}", "logprob": v}
                                                                   for k, v in top.items()]} for t, lp, top in tokens]}}]}


def llm_item(ids, tops):
    return Item(input={"messages": [{"role": "user", "content": "hi"}]},
                expect={"token_ids": ids, "text": "text", "top_logprobs": [[[k, v] for k, v in t.items()] for t in tops]})


LLM = {"max_tokens": 4, "top_logprobs": 5, "tie_logprob": 0.5, "eos_token_ids": [2]}


def test_a_continuation_agrees_token_by_token_and_drifts_by_its_logprobs():
    item = llm_item([5, 6, 2], [{5: -0.1, 7: -3.0}, {6: -0.2, 8: -2.0}, {2: -0.05}])
    r = ref("text-generation", [item], settings=LLM)
    same = Generation().compare(item, chat([(5, -0.12, {5: -0.12}), (6, -0.2, {6: -0.2}), (2, -0.05, {2: -0.05})]), r)
    assert same.agrees and same.drift == pytest.approx(0.01) and same.extra["tokens_compared"] == 2  # the end dropped
    ended_early = Generation().compare(item, chat([(5, -0.1, {5: -0.1}), (2, -0.1, {2: -0.1, 6: -0.3})]), r)
    assert not ended_early.agrees and "first divergent token at 1" in ended_early.detail


def test_a_parting_at_a_near_tie_agrees_and_one_far_from_it_drifts():
    item = llm_item([5, 6], [{5: -0.65, 9: -0.75}, {6: -0.1}])
    r = ref("text-generation", [item], settings=LLM)
    tie = Generation().compare(item, chat([(9, -0.6, {9: -0.6, 5: -0.7}), (4, -0.1, {4: -0.1})]), r)
    assert tie.agrees and tie.extra["near_tie"] and "a near tie" in tie.detail
    far = llm_item([5, 6], [{5: -0.1, 9: -3.0}, {6: -0.1}])
    apart = Generation().compare(far, chat([(9, -0.6, {9: -0.6, 5: -0.7}), (4, -0.1, {4: -0.1})]),
                                 ref("text-generation", [far], settings=LLM))
    assert not apart.agrees and apart.extra["first_divergence"] == 0


def test_a_transcript_drifts_by_its_word_error_rate():
    item = Item(input={"audio": ""}, expect={"text": "the cat sat on the mat"})
    r = ref("automatic-speech-recognition", [item])
    one_word = Speech().compare(item, {"text": "the cat sat on a mat"}, r)
    assert not one_word.agrees and one_word.drift == pytest.approx(1 / 6)
    assert Speech().compare(item, {"text": " the cat  sat on the mat "}, r).agrees


def test_without_the_frameworks_answers_the_served_one_is_held_to_the_right_one_only():
    item = Item(input="x", gold="pos")
    answer = Classification().compare_gold(item, classified("pos", softmax([0, 0, 1])))
    assert answer.agrees and answer.gold == {"served": True}
    with pytest.raises(ValueError, match="no right answer"):
        Detections().served_answer({})


def test_an_eval_set_is_read_line_by_line_with_its_files_beside_it(tmp_path):
    (tmp_path / "cat.png").write_bytes(b"\x89PNG fake")
    lines = ['{"image": "cat.png", "label": "cat"}', "", '"a bare text line is a text"']
    (tmp_path / "images.jsonl").write_text(lines[0] + "\n")
    (tmp_path / "texts.jsonl").write_text('{"text": "good", "label": "pos"}\n' + lines[2] + "\n")
    image = read_eval_set(tmp_path / "images.jsonl", "image-classification")[0]
    assert image.input["filename"] == "cat.png" and image.gold == "cat"
    texts = read_eval_set(tmp_path / "texts.jsonl", "text-classification")
    assert [(t.input, t.gold) for t in texts] == [("good", "pos"), ("a bare text line is a text", None)]
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": "hello"}) + "\n")
    assert read_eval_set(chats, "text-generation")[0].input == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("task, line, says", [
    ("text-classification", "{not json", "bad.jsonl:1: not JSON"),
    ("text-classification", '{"text": "x", "labels": "pos"}', "bad.jsonl:1: unknown field(s) labels"),
    ("image-classification", '{"image": "missing.png"}', "bad.jsonl:1: image 'missing.png': cannot be read"),
    ("text-generation", '{"prompt": "x", "messages": []}', "give exactly one of 'messages', 'prompt'"),
])
def test_a_bad_eval_set_line_is_named_by_file_and_line(tmp_path, task, line, says):
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    with pytest.raises(ReferenceError, match=says.replace("(", r"\(").replace(")", r"\)")):
        read_eval_set(tmp_path / "bad.jsonl", task)


def test_percentiles_are_read_off_a_histogram_as_prometheus_reads_them():
    buckets = {0.01: 50.0, 0.1: 90.0, 1.0: 100.0, math.inf: 100.0}  # cumulative
    assert quantile(0.5, buckets) == pytest.approx(0.01)  # the 50th of 100 is the first bucket's top
    assert quantile(0.7, buckets) == pytest.approx(0.01 + 0.09 * 20 / 40)
    assert quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * 9 / 10)
    assert quantile(0.99, {0.5: 10.0, math.inf: 100.0}) == 0.5  # in the +Inf bucket: its lower bound
    assert math.isnan(quantile(0.5, {0.1: 0.0, math.inf: 0.0}))


def test_a_model_without_a_reference_set_is_held_to_its_eval_sets_right_answers_only_and_says_so(tmp_path):
    from deploy.box_target import BoxTarget
    from rtxserve.eval_cli import reference_for

    (tmp_path / "entry").mkdir()
    target = BoxTarget("http://box")
    with pytest.raises(ReferenceError, match="entry/reference.json: no reference set"):
        reference_for(target, "m", tmp_path / "entry", None, None)
    with pytest.raises(ReferenceError, match="where its reference set is is not known here"):
        reference_for(target, "m", None, None, None)
    (tmp_path / "set.jsonl").write_text('{"text": "good", "label": "pos"}\n')
    gold = reference_for(target, "m", tmp_path / "entry", tmp_path / "set.jsonl", "text-classification")
    assert gold.framework.startswith("(none") and gold.items[0].gold == "pos" and gold.items[0].expect == {}
    (tmp_path / "plain.jsonl").write_text('"good"\n')
    with pytest.raises(ReferenceError, match="gives no right answers"):
        reference_for(target, "m", tmp_path / "entry", tmp_path / "plain.jsonl", "text-classification")

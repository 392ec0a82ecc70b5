"""The load run's options: parsed once, checked before any load, rendered into the locust command."""

import argparse
import json

import pytest

from loadtest.runner import LoadSpec, scenario_argv, scenario_options
from loadtest.scenarios import workloads
from loadtest.scenarios.answers import WrongAnswer, read_stream
from loadtest.scenarios.apis import Load
from loadtest.scenarios.options import parse_mix, parse_pairs
from loadtest.sweep import knee, over_saturated, step_values


def test_only_changed_options_reach_locust_and_every_flag_is_one_locust_knows():
    options = scenario_options(scenario="chat", model="m", no_stream=True, rate=2.5, arrival="poisson")
    argv = scenario_argv(options)
    assert argv == ["--scenario", "chat", "--model", "m", "--no-stream", "--arrival", "poisson", "--rate", "2.5"]
    spec = LoadSpec("http://h:1", options, workers=2, duration_s=20, warmup_s=2)
    command = spec.locust_argv(__import__("pathlib").Path("/out"))
    assert command[command.index("-u") + 1] == "2"  # open loop: one arrival schedule per worker process
    assert command[command.index("--processes") + 1] == "2" and command[command.index("-t") + 1] == "20s"
    assert command[-2:] == ["--processes", "2"] and "--samples-out" in command


def test_closed_loop_stages_add_the_shape_and_set_the_duration():
    spec = LoadSpec("http://h:1", scenario_options(model="m", stages="10:2,5:4"), users=3, warmup_s=1)
    command = spec.locust_argv(__import__("pathlib").Path("/out"))
    assert command[command.index("-f") + 1].endswith("locustfile.py," + str(spec.locust_argv.__globals__["SCENARIOS"] / "stages.py"))
    assert spec.duration == 15 and command[command.index("-t") + 1] == "15s"


@pytest.mark.parametrize("change, message", [
    ({"arrival": "poisson"}, "needs --rate"),
    ({"scenario": "mix"}, "needs --mix"),
    ({"mix": "classify:m", "scenario": "mix"}, "API:MODEL:WEIGHT"),
    ({"model": ""}, "--model is required"),
    ({"workload": "random", "scenario": "chat"}, "needs --tokenizer"),
    ({"workload": "file"}, "needs --dataset"),
    ({"dataset": "/nonexistent.jsonl"}, "does not exist"),
    ({"dataset": "/tmp"}, "fits none of classify"),  # a folder is images; classify takes texts
    ({"stages": "10"}, "SECONDS:VALUE"),
    ({"prompt_words": "9,2", "scenario": "chat"}, "min <= max"),
    ({"chat_images": 1}, "applies to chat"),
    ({"image_dir": "/tmp", "scenario": "chat"}, "give --chat-images"),
])
def test_a_run_that_cannot_work_is_refused_before_any_load(change, message):
    spec = LoadSpec("http://h:1", scenario_options(model="m") | change, duration_s=10, warmup_s=1)
    with pytest.raises(ValueError, match=message):
        spec.check()


def test_unknown_scenario_options_are_named():
    with pytest.raises(ValueError, match="max_inflight"):
        scenario_options(max_inflight=3)


def test_pairs_and_mix_parse():
    assert parse_pairs("10:2, 20:4.5", "--stages") == [(10.0, 2.0), (20.0, 4.5)]
    assert parse_mix("classify:a:3,chat:b:1") == [("classify", "a", 3.0), ("chat", "b", 1.0)]
    with pytest.raises(ValueError, match="API one of"):
        parse_mix("nope:a:1")


def test_random_token_prompts_have_the_drawn_lengths(tmp_path):
    from fixture_models.llm import train_chat_tokenizer

    tokenizer = train_chat_tokenizer(512)
    tokenizer.save_pretrained(tmp_path)
    prompts = workloads.random_token_prompts(tmp_path / "tokenizer.json", 20, 32, 16, 0.25, seed=1)
    encoded = [len(tokenizer(p.text, add_special_tokens=True).input_ids) for p in prompts]
    assert encoded == [p.input_tokens for p in prompts]  # what is recorded is what the server will count
    assert sum(24 <= n <= 40 for n in encoded) >= 18 and len(set(encoded)) > 1
    assert all(12 <= p.max_tokens <= 20 for p in prompts)
    again = workloads.random_token_prompts(tmp_path / "tokenizer.json", 20, 32, 16, 0.25, seed=1)
    assert [p.text for p in again] == [p.text for p in prompts]  # the same seed, the same workload


def test_dataset_files_jsonl_prompts_and_sharegpt(tmp_path):
    (tmp_path / "p.jsonl").write_text('"hello there"\n{"prompt": "count to five", "max_tokens": 9}\n')
    prompts = workloads.read_prompts(tmp_path / "p.jsonl")
    assert [p.text for p in prompts] == ["hello there", "count to five"] and prompts[1].max_tokens == 9
    share = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello you two"},
                                {"from": "human", "value": "and?"}, {"from": "gpt", "value": "done"}]}]
    (tmp_path / "s.json").write_text(json.dumps(share))
    (p,) = workloads.read_prompts(tmp_path / "s.json")
    assert [m["role"] for m in p.messages] == ["user", "assistant", "user"] and p.max_tokens == 1
    (tmp_path / "bad.jsonl").write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        workloads.read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "t.txt").write_text("one\n\ntwo\n")
    assert workloads.read_texts(tmp_path / "t.txt") == ["one", "two"]


def test_a_mix_builds_each_apis_workload():
    options = argparse.Namespace(**scenario_options(scenario="mix", mix="classify:a:3,image:v:1,chat:b:1"))
    load = Load.from_options(options)
    assert load.entries == [("classify", "a"), ("image", "v"), ("chat", "b")] and load.weights == [3, 1, 1]
    assert load.texts and len(load.images) > 1 and load.prompts and not load.ignore_eos


def test_stream_reading_times_tokens_and_refuses_cut_or_failed_streams():
    lines = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', b"",
             b'data: {"choices":[{"delta":{"content":"hi"}}]}', b'data: {"choices":[],"usage":{"completion_tokens":2,"prompt_tokens":5}}',
             b"data: [DONE]"]
    figures = read_stream(iter(lines), started=0.0)
    assert figures["output_tokens"] == 2 and figures["prompt_tokens"] == 5 and len(figures["itl_ms"]) == 1
    with pytest.raises(WrongAnswer, match="no \\[DONE\\]"):
        read_stream(iter(lines[:3]), 0.0)
    with pytest.raises(WrongAnswer, match="stream error: boom"):
        read_stream(iter([b'data: {"error": {"message": "boom"}}']), 0.0)


def _step(load, qps, p99, errors=0, requests=100, late=0.0, capped=0.0, slo_p99=None):
    return {"load": load, "qps": qps, "sent_rps": load, "p99_ms": p99, "errors": errors, "requests": requests,
            "error_fraction": errors / requests, "late_fraction": late, "capped_fraction": capped,
            "slo_p99_ms": slo_p99 or {}}


def test_over_saturation_is_recognised_in_open_and_closed_loops():
    assert over_saturated([_step(10, 9.5, 20)], True, {}) == ""
    assert "completed 7.0 of the 10.0 requests/s sent" in over_saturated([_step(10, 7.0, 20)], True, {})
    assert "failed" in over_saturated([_step(10, 10, 20, errors=20)], True, {})
    # arrivals held by the in-flight cap are the server's backlog; held by a busy load generator, they are not
    assert "20% of the arrivals waited for the in-flight cap" in over_saturated([_step(10, 10, 20, late=0.3, capped=0.2)], True, {})
    assert over_saturated([_step(10, 10, 20, late=0.3, capped=0.05)], True, {}) == ""
    # arrivals held by the cap are said before what was completed of what was sent, which they make meaningless
    assert "waited for the in-flight cap" in over_saturated([_step(10, 7.0, 20, late=0.3, capped=0.2)], True, {})
    assert "gave 50.0 QPS" in over_saturated([_step(4, 49, 40), _step(8, 50, 90)], False, {})
    assert over_saturated([_step(4, 30, 40), _step(8, 50, 90)], False, {}) == ""
    far = [_step(1, 1, 10, slo_p99={"e2el": 30}), _step(2, 2, 10, slo_p99={"e2el": 40})]
    assert "twice the SLO" in over_saturated(far, True, {"e2el": 10})


def test_knee_and_step_values():
    steps = [_step(x, x, p) for x, p in [(1, 10), (2, 10.5), (4, 11), (8, 12), (16, 40), (32, 200)]]
    assert knee(steps)["load"] == 16  # Kneedle: the point farthest below the chord of the normalised curve
    assert knee(steps[:2]) is None
    assert step_values("", 2, 5) is None and step_values("1,2,4", 1, 5) == [1, 2, 4]
    with pytest.raises(ValueError, match="increasing"):
        step_values("4,2", 1, 5)


def test_a_wrong_answer_is_a_failure_that_says_why():
    from loadtest.scenarios.answers import check_encoded

    check_encoded("classify", [{"label": "pos"}, {"label": "neg"}], 2)
    for api, data, message in (("classify", [{"label": "pos"}], "expected 2 results, got 1"),
                               ("classify", [{"label": 3}, {"label": "x"}], "no label"),
                               ("ner", [{"entities": []}, {}], "no entity list"),
                               ("embeddings", [{"embedding": [0.1, 0.2]}, {"embedding": [0.1]}], "sizes \\[1, 2\\]"),
                               ("classify", None, "got NoneType")):
        with pytest.raises(WrongAnswer, match=message):
            check_encoded(api, data, 2)


def test_a_fractional_duration_becomes_whole_seconds_for_locust():
    spec = LoadSpec("http://h:1", scenario_options(model="m"), duration_s=6.2, warmup_s=1)
    command = spec.locust_argv(__import__("pathlib").Path("/out"))
    assert command[command.index("-t") + 1] == "7s"  # locust takes whole seconds only


def test_chat_images_are_attached_to_the_last_user_message():
    from loadtest.scenarios.apis import data_url, with_images
    from loadtest.scenarios.workloads import builtin_images

    url = data_url(builtin_images(1)[0])
    assert url.startswith("data:image/png;base64,")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    sent = with_images(messages, [url, url])
    assert sent[0] == messages[0] and messages[1]["content"] == "hi"  # the workload's prompt is left as it was
    assert sent[1]["content"] == [{"type": "text", "text": "hi"}, *[{"type": "image_url", "image_url": {"url": url}}] * 2]

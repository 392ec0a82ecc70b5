"""A trace fitted to a box (loadtest/scenarios/fitting.py): the window in the trace's own time, the length multipliers,
prompts skipped or clamped, outputs and idle gaps capped, each change counted; bad options refused before anything is
sent, naming the option; a trace checked against the models' contexts, with the options that fit it; `--analyze`."""

import argparse
import json

import pytest

from loadtest.scenarios.fitting import Fit, analyze, over_context
from loadtest.scenarios.replayer import read_trace

# Mooncake's shape: timestamps in ms, 512-token hash blocks; long prompts, a shared first block
TRACE = [{"timestamp": 0, "input_length": 6900, "output_length": 300, "hash_ids": [0, 1, 2]},
         {"timestamp": 1000, "input_length": 1200, "output_length": 40, "hash_ids": [0, 3]},
         {"timestamp": 61000, "input_length": 120000, "output_length": 900, "hash_ids": [0, 4, 5]},
         {"timestamp": 62000, "input_length": 300, "output_length": 20, "hash_ids": [6]}]


def _trace(tmp_path, fit: Fit = Fit(), speed: float = 1.0):
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TRACE))
    return read_trace(path, model="llm", speed=speed, fit=fit)


def test_as_recorded_nothing_changes_and_nothing_is_counted(tmp_path):
    trace = _trace(tmp_path)
    assert [(r.at, r.input_tokens, r.output_tokens) for r in trace.requests] == [
        (0.0, 6900, 300), (1.0, 1200, 40), (61.0, 120000, 900), (62.0, 300, 20)]
    assert trace.block_tokens == 512 and not trace.fitted and not trace.skipped


def test_a_window_starts_the_replay_at_its_start_and_counts_what_it_leaves_out(tmp_path):
    trace = _trace(tmp_path, Fit(start_s=0.5, end_s=61.5), speed=2.0)
    assert [(r.at, r.input_tokens) for r in trace.requests] == [(0.25, 1200), (30.25, 120000)]
    assert trace.fitted == {"left out of the window 0.5 to 61.5 s": 2}


def test_lengths_are_scaled_then_skipped_clamped_and_capped_each_counted(tmp_path):
    fit = Fit(prompt_scale=0.1, output_scale=0.5, max_prompt=5000, clamp_prompt=400, max_output=100, prefix_scale=0.25)
    trace = _trace(tmp_path, fit)
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [(400, 100), (120, 20), (30, 10)]
    assert trace.skipped == {"longer than --max-prompt 5000 tokens": 1}  # 12,000 after scaling
    assert trace.fitted["prompts clamped to 400 tokens"] == 1 and trace.fitted["outputs capped at 100 tokens"] == 1
    assert trace.fitted["prompts scaled 0.1x"] == 3 and trace.fitted["outputs scaled 0.5x"] == 3  # not the skipped
    assert trace.block_tokens == 128 and trace.requests[0].hash_ids == (0, 1, 2)  # the sharing kept, shorter


def test_idle_gaps_are_cut_after_the_speed(tmp_path):
    trace = _trace(tmp_path, Fit(max_idle_s=5.0), speed=2.0)
    assert [r.at for r in trace.requests] == [0.0, 0.5, 5.5, 6.0]
    assert trace.fitted == {"idle gaps cut to 5 s": 1}


@pytest.mark.parametrize("options, message", [
    ({"trace_window": "100:200"}, "--trace-window 100:200 holds no request: the trace runs from 0 to 62.0 s"),
    ({"trace_window": "20:10"}, "--trace-window: expected START:END"),
    ({"trace_window": "soon"}, "--trace-window: expected START:END"),
    ({"prompt_scale": 0.0}, "--prompt-scale must be > 0"),
    ({"prefix_scale": -1.0}, "--prefix-scale must be > 0"),
    ({"max_output": -4}, "--max-output must be >= 0"),
    ({"max_prompt": 100}, "--max-prompt 100 is below every prompt in the window (the smallest: 300 tokens)"),
])
def test_a_fit_that_cannot_be_replayed_is_refused_naming_the_option(tmp_path, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _trace(tmp_path, Fit.from_options(argparse.Namespace(**options)))


def test_requests_over_the_context_stop_the_replay_with_the_options_that_fit_it(tmp_path):
    trace = _trace(tmp_path)
    why = over_context(trace, {"llm": 8192})
    assert why.startswith("1 of 4 requests need more than their model's context (llm: 8192 tokens;")
    assert "max 120900): the model would refuse them" in why
    # the longest output is 900: prompts up to 7,292 fit beside it
    assert "--clamp-prompt 7292 (cut the longer prompts), --max-prompt 7292 (skip them: 3 of 4 would be sent)" in why
    assert "--send-anyway" in why
    small = over_context(trace, {"llm": 512})  # outputs alone pass half the context: capped first
    assert "--max-output 128 with --clamp-prompt 384" in small
    fitted = _trace(tmp_path, Fit(clamp_prompt=384, max_output=128))
    assert over_context(fitted, {"llm": 512}) is None and over_context(trace, {"other": 512}) is None


def test_analyze_says_what_the_trace_holds_and_what_fits(tmp_path):
    text = analyze(_trace(tmp_path), {"llm": 8192})
    assert text.splitlines()[0] == "trace: mooncake, 4 requests over 62.0 s (0.06/s), models: llm"
    assert "prompt tokens: P50 4050," in text and "max 120000" in text
    assert "prefix blocks seen before: 22% of 9 (512 tokens each)" in text  # block 0, twice again
    assert "fits llm (8192-token context): 3 of 4 requests" in text
    assert "fits llm: not known" in analyze(_trace(tmp_path), None)


def test_an_error_answer_s_reason_is_its_message_bounded_and_without_echoed_text():
    from loadtest.scenarios.answers import reason

    assert reason('{"error": {"message": "This model\'s maximum context length is 512 tokens.", "type": "x"}}') == \
        "This model's maximum context length is 512 tokens."
    assert reason('{"detail": "Not Found"}') == "Not Found" and reason("upstream\n  down") == "upstream down"
    echoed = reason('{"error": {"message": "bad input \'' + "my private prompt text " * 3 + '\' here"}}')
    assert echoed == "bad input '...' here"
    assert len(reason("x" * 500)) == 200

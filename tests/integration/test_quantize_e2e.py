"""`rtxserve export llm --quantize` for real: llm-compressor in its own environment quantises the tiny Llama with
each scheme, the accuracy report holds it to the unquantised model, vLLM serves the package as it is, and the
`openai` SDK calls it through the gateway."""

import json

import openai
import pytest

from deploy.plan import GIB, plan
from deploy.spec import parse_deployment
from export.llm import LLMOptions, export_llm
from serve.stack import start_gateway, start_vllm
from serve.vllm import VLLMOptions
from tests.integration import VLLM_EAGER

SCHEMES = ("w4a16", "w8a8-int8", "w8a8-fp8")
# what each scheme stores a Linear's weight as, and beside it (compressed-tensors, as vLLM reads it)
STORED = {"w4a16": ("weight_packed", "I32"), "w8a8-int8": ("weight", "I8"), "w8a8-fp8": ("weight", "F8_E4M3")}


@pytest.fixture(scope="module")
def packages(llm_fixtures, tmp_path_factory):
    work = tmp_path_factory.mktemp("quantized")
    return {s: export_llm(llm_fixtures / "base", work / s, LLMOptions(quantize=s)) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_is_measured_against_the_unquantised_model(packages, scheme):
    from safetensors import safe_open

    done = packages[scheme]
    parity = json.loads((done.out / "parity.json").read_text())["quantization"]
    assert parity["scheme"] == scheme and parity["passed"] and parity["tokens"] > 100
    ppl = parity["perplexity"]
    assert parity["perplexity_increase"] == pytest.approx(ppl["quantized"] / ppl["reference"] - 1)
    assert abs(parity["perplexity_increase"]) < 0.05 and 0 <= parity["mean_kl"] < 0.01
    # the fixture is nearly random: its next-token scores lie close together, and int4 flips more of their argmaxes
    assert parity["top1_agreement"] > (0.75 if scheme == "w4a16" else 0.9)
    assert [g["prompt"] for g in parity["greedy"]] and all(g["reference"] and g["quantized"] for g in parity["greedy"])
    calibrated = scheme != "w8a8-fp8"
    assert parity["calibration"]["samples"] == (32 if calibrated else 0)
    config = json.loads((done.out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    name, dtype = STORED[scheme]
    with safe_open(done.out / "model.safetensors", "np" if dtype != "F8_E4M3" else "pt") as f:
        assert f.get_slice(f"model.layers.0.mlp.down_proj.{name}").get_dtype() == dtype
        assert f.get_slice("lm_head.weight").get_dtype() == "F32"  # as the fixture stores it
    # the planner counts it as stored
    estimate = plan(parse_deployment({"name": "q", "models": [{"name": "q", "kind": "llm", "path": str(done.out)}]}),
                    check=False).estimates["q"]
    assert estimate.parts["weights"] == pytest.approx((done.out / "model.safetensors").stat().st_size / GIB, rel=0.01)


def test_a_lora_is_merged_with_its_parity_then_quantised(llm_fixtures, tmp_path):
    done = export_llm(llm_fixtures / "adapter-a", tmp_path / "merged-fp8", LLMOptions(quantize="w8a8-fp8"))
    parity = json.loads((done.out / "parity.json").read_text())
    assert parity["before_quantization"]["passed"] and parity["quantization"]["passed"]
    assert done.metadata["quantized_from"]["kind"] == "merged" and not any(done.out.glob("adapter_*"))


@pytest.fixture(scope="module")
def served(packages, tmp_path_factory):
    """The w8a8-int8 package (int8 kernels on AVX2 and AVX-512 alike) in the real vLLM, behind the gateway."""
    logs = tmp_path_factory.mktemp("quantized-logs")
    vllm, vllm_url = start_vllm(VLLMOptions(model=packages["w8a8-int8"].out, served_name="tiny-int8",
                                            max_model_len=512, extra_args=VLLM_EAGER), logs)
    try:
        gateway, url = start_gateway("", logs, vllm_url=vllm_url)
        yield url
        gateway.stop()
    finally:
        vllm.stop()


def test_vllm_serves_the_package_as_it_is_through_the_gateway(served):
    sdk = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in sdk.models.list()] == ["tiny-int8"]
    chat = sdk.chat.completions.create(model="tiny-int8", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content
    stream = sdk.completions.create(model="tiny-int8", prompt="the quick brown", max_tokens=6, temperature=0,
                                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6 and "".join(c.choices[0].text for c in chunks if c.choices)

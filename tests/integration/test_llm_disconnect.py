"""A client that goes away mid-stream must not leave vLLM generating for nobody (the gateway closes the
upstream stream, and vLLM aborts the request).

On the "small" Llama fixture (58M parameters), not the session's 2-layer one: that one writes 230 tokens in about
0.6 s here, and on a busy machine (the other test worker at work beside it) this test's own client took 0.4 s to
read the stream's first two chunks, so the generation could end before the client had left. The small one writes
about 137 tokens a second with three busy loops beside it on an AVX-512 machine, 25 alone on CI's two AVX2 cores
(and a few beside the other test worker): TOKENS take it more than a second even on the fast machine."""

import re

import httpx
import pytest

from fixture_models.llm import write_llm
from serve.stack import start_gateway, start_vllm
from serve.vllm_server import VLLMOptions
from tests.conftest import built_once
from tests.integration import VLLM_EAGER, until

TOKENS = 240


@pytest.fixture(scope="module")
def small_llm(tmp_path_factory):
    """(gateway URL, vLLM URL) over the small Llama."""
    model = built_once(tmp_path_factory, "small-llama", lambda out: write_llm(out, shape="small"))
    logs = tmp_path_factory.mktemp("small-llm-logs")
    vllm, vllm_url = start_vllm(VLLMOptions(model=model, served_name="small-llama", max_model_len=512,
                                            extra_args=list(VLLM_EAGER)), logs)
    try:
        gateway, url = start_gateway("", logs, vllm_url=vllm_url)
        yield url, vllm_url
        gateway.stop()
    finally:
        vllm.stop()


def _metric(vllm_url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{vllm_url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*{labels}[^}}]*}} (\S+)$", text, re.M))


def _completed(vllm_url: str) -> float:
    """Requests vLLM finished on its own (max_tokens reached or a stop), not aborted."""
    return sum(_metric(vllm_url, "vllm:request_success_total", f'finished_reason="{r}"') for r in ("length", "stop"))


def _idle(vllm_url: str) -> None:
    """Until vLLM runs nothing: its counters and its running gauge are recorded together, once per engine step, so a
    request whose steps showed it running is counted in full once the gauge says 0."""
    until(lambda: _metric(vllm_url, "vllm:num_requests_running") == 0, "vLLM running nothing", limit_s=60)


def test_client_disconnect_aborts_the_generation_in_vllm(small_llm):
    gateway, vllm_url = small_llm
    body = {"model": "small-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    # With ignore_eos, a run goes to max_tokens unless something stops it: a short one, run to its end, shows that
    # the counter below sees finished requests (TOKENS of them took 60 s to 120 s beside the other test worker)
    whole = httpx.post(f"{gateway}/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=600).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    _idle(vllm_url)  # the short run counted: the baseline
    before, completed = _metric(vllm_url, "vllm:generation_tokens_total"), _completed(vllm_url)
    assert completed >= 1  # the run above (and the gateway's canary): the counter does see finished requests
    chunks = 0
    body["stream"] = True
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 2:
                break  # leaving the block closes the connection mid-stream
    _idle(vllm_url)  # a wait, not a speed: what is tested is that the generation stops short of TOKENS
    generated = _metric(vllm_url, "vllm:generation_tokens_total") - before
    assert _completed(vllm_url) == completed, "the abandoned generation ran to its end"
    assert 1 <= generated < TOKENS, f"vLLM generated {generated:g} of {TOKENS} tokens for a client that left after 2"

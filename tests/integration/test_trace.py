"""The traffic trace of a real gateway in front of the real Triton and vLLM: what it records of each request is what
the engines answered (their token counts, as the `openai` SDK reads them), shared prompt prefixes share their hash
ids, and no text is written."""

import json

import httpx
import openai

from serve.stack import start_gateway

from .conftest import MODEL

SYSTEM = "You are the assistant of a small bicycle shop. Answer questions about orders, repairs and refunds. " * 2
SECRET = "zanzibar"


def test_the_trace_holds_what_the_engines_answered_and_no_text(stack, llm_servers, tmp_path):
    _, vllm_url, _ = llm_servers
    gateway, url = start_gateway(stack.triton_grpc_url, tmp_path / "logs", vllm_url=vllm_url,
                                 extra_env={"RTXSERVE_TRACE_DIR": str(tmp_path / "trace")})
    try:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert httpx.post(f"{url}/v1/classify", json={"model": MODEL, "input": [f"great {SECRET}", "awful"]},
                          timeout=30).status_code == 200
        usages = []
        for question in (f"where is order {SECRET}? Tell me all you know of it, the day it left and the day it comes.",
                         "when is my repair done? Tell me what was broken, what was mended and what it all costs."):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            chunks = list(sdk.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6,
                                                      stream=True, stream_options={"include_usage": True}))
            usages.append(chunks[-1].usage)
    finally:
        gateway.stop()  # SIGTERM: the process writes what is queued before it ends
    lines = [json.loads(x) for f in (tmp_path / "trace").glob("trace-*.jsonl") for x in f.read_text().splitlines()]
    text = "".join(f.read_text() for f in (tmp_path / "trace").iterdir())
    assert SECRET not in text and "bicycle" not in text
    classify, *chats = sorted(lines, key=lambda line: line["t"])
    assert (classify["route"], classify["model"], classify["items"], classify["chars"]) == ("/v1/classify", MODEL, 2, 19)
    assert [(c["input_tokens"], c["output_tokens"]) for c in chats] == [
        (u.prompt_tokens, u.completion_tokens) for u in usages]
    assert all(c["status"] == 200 and c["model"] == "tiny-llama" and 0 < c["ttft_ms"] <= c["latency_ms"]
               for c in chats)
    shared = (len("system\x00") + len(SYSTEM)) // 64  # the system prompt's full blocks
    assert chats[0]["hash_ids"][:shared] == chats[1]["hash_ids"][:shared]  # and then the questions differ
    assert min(len(c["hash_ids"]) for c in chats) > shared and chats[0]["hash_ids"][shared] != chats[1]["hash_ids"][shared]

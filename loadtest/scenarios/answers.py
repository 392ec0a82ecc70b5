"""What counts as an answer in a load test: a non-200 status is a failure with its code, and an answer that came but
is not a whole, valid one (fewer results than inputs, a result without its label, entities or detections, no tokens,
a stream cut short) raises WrongAnswer, whose message the report counts. Streams are read line by line as they arrive
and timed the way `vllm bench serve` times them: time to first token (TTFT) is the first event that carries choices,
the inter-token gaps (ITL) are between successive such events, output tokens come from the usage event.
"""

from __future__ import annotations

import json
import time


class WrongAnswer(Exception):
    """The answer came but is not a whole, valid one; the message is what the report counts."""


def failed_status(response) -> bool:
    """Whether the request failed (not a 200): marked failed then, with its status and the server's reason."""
    if response.status_code == 200:
        return False
    if response.status_code:  # 0: no answer at all; locust records the connection error itself
        response.failure(f"HTTP {response.status_code}: {reason(response.text or '')}")
    return True


def reason(body: str, limit: int = 200) -> str:
    """What an error answer says: the message of OpenAI's error shape (ours, vLLM's) or FastAPI's detail, else the body's
    start; at most `limit` characters, and any quoted text of 40 characters or more left out (an echoed prompt)."""
    import re

    try:
        data = json.loads(body)
    except ValueError:
        data = None
    message = body
    if isinstance(data, dict):
        error = data.get("error")
        found = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else data.get("detail")
        message = found if isinstance(found, str) else message
    message = re.sub(r"'[^']{40,}'|\"[^\"]{40,}\"", "'...'", " ".join(message.split()))
    return message[:limit]


def check_encoded(api: str, data, n: int) -> None:
    """An encoder API's `data`: a result per input, each with what its API answers (a label, entities, detections,
    an embedding, all of one size)."""
    if not isinstance(data, list) or len(data) != n:
        raise WrongAnswer(f"expected {n} results, got {len(data) if isinstance(data, list) else type(data).__name__}")
    if api in ("classify", "image") and not all(isinstance(d.get("label"), str) for d in data):
        raise WrongAnswer("a result has no label")
    if api == "ner" and not all(isinstance(d.get("entities"), list) for d in data):
        raise WrongAnswer("a result has no entity list")
    if api == "detect" and not all(isinstance(d.get("detections"), list) for d in data):
        raise WrongAnswer("a result has no detection list")
    if api == "embeddings":
        sizes = {len(d.get("embedding") or ()) for d in data}
        if len(sizes) != 1 or 0 in sizes:
            raise WrongAnswer(f"embeddings of sizes {sorted(sizes)}")


def whole_answer(answer: dict) -> dict:
    """A generation answered at once: read_stream's figures without the timings (its tokens, model and text)."""
    usage = answer.get("usage") or {}
    tokens = usage.get("completion_tokens")
    if not answer.get("choices") or not tokens:
        raise WrongAnswer("no choices or no completion tokens")
    choice = answer["choices"][0]
    text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    return {"output_tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"), "model": answer.get("model"),
            "text": text or ""}


def answered_by(response, answer: dict) -> None:
    """The model the answer names: behind an alias, the target that answered (the report splits by it)."""
    if isinstance(answer.get("model"), str):
        response.request_meta["context"]["model"] = answer["model"]  # locust copied `context` into the request


def read_stream(lines, started: float) -> dict:
    """Streaming figures of one SSE answer from its lines as they arrive; `started` is the send time
    (perf_counter). Raises WrongAnswer on an error event, an unparsable event, no [DONE] or no tokens."""
    token_times, usage, model, text = [], {}, None, []
    for line in lines:
        arrived = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise WrongAnswer(f"unparsable event {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise WrongAnswer(f"event is not a JSON object: {payload[:80]!r}")
        if "error" in chunk:
            error = chunk["error"]
            raise WrongAnswer(f"stream error: {error.get('message') if isinstance(error, dict) else error}")
        if chunk.get("choices"):
            token_times.append(arrived)
            model = model or chunk.get("model")
            choice = chunk["choices"][0]
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
        elif chunk.get("usage"):
            usage = chunk["usage"]
    else:
        raise WrongAnswer("stream cut: no [DONE]")
    tokens = usage.get("completion_tokens", len(token_times))
    if not tokens or not token_times:
        raise WrongAnswer("no output tokens")
    return {
        "ttft_ms": (token_times[0] - started) * 1000,
        "itl_ms": [(b - a) * 1000 for a, b in zip(token_times, token_times[1:])],
        "output_tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens"),
        "model": model,
        "text": "".join(text),
    }

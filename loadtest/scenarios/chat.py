"""Closed-loop streamed chat: each user streams /v1/chat/completions as soon as its last answer ended.

Per request: time to first token (first chunk with text), every gap between text chunks, output tokens
(the usage chunk's count, else the text chunks) and the whole latency, which replaces locust's own time
(with stream=True that stops at the response headers). A non-200, an error event, a stream without
[DONE] or zero output tokens is a failure.
Env: RTXSERVE_MODEL, RTXSERVE_MAX_TOKENS (default 64), RTXSERVE_PROMPT_WORDS ("min,max" words in each
prompt, drawn uniformly; default "4,120").
"""

import itertools
import json
import os
import random
import time

import requests
from locust import HttpUser, constant, task

from loadtest.scenarios import samples  # noqa: F401  (registers the raw-sample recorder)

MODEL = os.environ.get("RTXSERVE_MODEL", "")
MAX_TOKENS = int(os.environ.get("RTXSERVE_MAX_TOKENS", "64"))
PROMPT_WORDS = os.environ.get("RTXSERVE_PROMPT_WORDS", "4,120")
TEMPERATURE = 0.7
SEED = 0  # user i draws its prompts from Random(SEED + i): the same prompts on every run
# Plain words that tokenizers (the test fixture's tiny one included) map to about one token each, so
# prompt length in words tracks prompt length in tokens.
WORDS = ("the a an and or of in on with about is can your orders package shipping refunds invoice questions "
         "answer answers help model served today tuesday quick brown fox jumps over lazy dog fine gateway "
         "how you i arrived attached day compatible").split()


def _word_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    if not (low.strip().isdigit() and high.strip().isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"RTXSERVE_PROMPT_WORDS must be 'min,max' with 1 <= min <= max, not {text!r}")
    return int(low), int(high)


WORD_RANGE = _word_range(PROMPT_WORDS)
_user_numbers = itertools.count()


class StreamFailed(Exception):
    """The stream gave no whole answer; the message is what locust records."""


def read_stream(lines, started: float) -> dict:
    """Streaming figures of one SSE answer, from its lines as they arrive; `started` is the send time
    (perf_counter). TTFT is None when the answer had tokens but no text (e.g. it stopped at once)."""
    text_times, usage_tokens = [], None
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
            raise StreamFailed(f"stream error: unparsable event {payload[:80]!r}") from None
        if "error" in chunk:
            error = chunk["error"]
            raise StreamFailed(f"stream error: {error.get('message') if isinstance(error, dict) else error}")
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or ()):
            text_times.append(arrived)
    else:
        raise StreamFailed("stream cut: no [DONE]")
    tokens = usage_tokens if usage_tokens is not None else len(text_times)
    if not tokens:
        raise StreamFailed("no output tokens")
    return {
        "ttft_ms": (text_times[0] - started) * 1000 if text_times else None,
        "itl_ms": [(b - a) * 1000 for a, b in zip(text_times, text_times[1:])],
        "output_tokens": tokens,
    }


class ChatUser(HttpUser):
    # requests, not FastHttpUser: its iter_content(n) waits for n bytes, which would batch the tokens.
    wait_time = constant(0)

    def on_start(self):
        self.rng = random.Random(SEED + next(_user_numbers))

    @task
    def chat(self):
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(*WORD_RANGE)))
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "temperature": TEMPERATURE, "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, name="chat", stream=True,
                              catch_response=True) as response:
            if response.status_code != 200:
                if response.status_code:  # 0: no answer at all; locust records the connection error itself
                    response.failure(f"HTTP {response.status_code}: {(response.text or '')[:120]}")
                return
            try:
                figures = read_stream(response.iter_lines(), started)
                response.request_meta["context"] = {**response.request_meta["context"], **figures}
            except StreamFailed as exc:
                response.failure(str(exc))
            except requests.RequestException as exc:
                response.failure(f"stream cut: {type(exc).__name__}")
            finally:
                response.request_meta["response_time"] = (time.perf_counter() - started) * 1000

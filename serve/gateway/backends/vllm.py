"""vLLM client for the gateway: its OpenAI server over HTTP (loopback), requests already validated.

On aiohttp: per call and per streamed event it costs a fraction of httpx's CPU (B1s in ../shared/BENCH.md).
Streams are relayed as vLLM's bytes: the events one read brings are split where SSE splits them and passed on
together in one write; a token event (`data: {"id":...}` on one line) is not parsed at all. Only what the
gateway must see is parsed: the final usage chunk (counted), an error event and anything unexpected (each ends
the stream with our error event). Closing the upstream response (client gone, deadline) makes vLLM abort the
generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson

from core.contract import SPEECH_RECOGNITION, TEXT_GENERATION, TEXT_RANKING

from ..exceptions import (
    BackendConnectFailed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
)
from .base import Backend, ModelInfo, Stream, StreamBroken, StreamChunk, Upload

log = logging.getLogger("rtxserve.gateway.vllm")
_JSON = {"content-type": "application/json"}
# SSE ends an event at a blank line and a line at CR LF, LF or CR (never at U+2028 and the like, which vLLM's JSON
# carries unescaped when a model writes them: the split is on bytes).
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\r|\n")


@contextlib.contextmanager
def _mapped(model: str):
    """aiohttp's errors of a call to vLLM, as the gateway's."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:  # nothing was sent: another replica may take it
        raise BackendConnectFailed(f"model {model} is not reachable; retry shortly") from exc
    except asyncio.TimeoutError as exc:
        raise BackendTimeout(f"model {model} did not answer within the deadline") from exc
    except aiohttp.ClientError as exc:  # sent, then the answer broke off (reset, cut, garbage): never resent
        log.warning("vllm %s: %s", model, type(exc).__name__)
        raise BackendError(f"model {model}'s answer broke off before it was complete") from exc


def _error(content: bytes) -> tuple[str, str | None]:
    """vLLM's error message and the parameter it names, if any."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return "", None
    error = body.get("error", body) if isinstance(body, dict) else {}
    if not isinstance(error, dict):
        return str(error), None
    param = error.get("param")
    return str(error.get("message", "")), str(param) if isinstance(param, str) and param else None


def raise_for_status(status: int, content: bytes, model: str) -> None:
    """Map a vLLM error answer to the gateway's error; vLLM's 400 messages are about the input."""
    if status < 400:
        return
    message, param = _error(content)
    log.warning("vllm %s: HTTP %s %s", model, status, message[:300])
    if status in (400, 422):
        raise InvalidRequest(message[:1000] or f"model {model} rejected the request", param=param)
    if status in (404, 503):
        raise BackendUnavailable(f"model {model} is not available right now; retry shortly")
    raise BackendError(f"model {model} failed to process the request")


class VLLMBackend(Backend):
    kind = "vllm"

    def __init__(self, url: str, timeout_s: float, control: str = "", serves: tuple[str, ...] = (), sleep_level: int = 1):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.task: str | None = None  # what the engine serves, read from its routes once it answers
        # An on-demand engine: where its sleep API answers (vLLM's own on a GPU, serve/engine_control.py's on a CPU),
        # and the models it serves (listed, not ready, while it sleeps)
        self.control, self.serves, self.sleep_level = control.rstrip("/"), serves, sleep_level
        self.swaps = bool(control)

    async def start(self) -> None:
        # timeout_s bounds each wait for bytes (as a read timeout), not a whole generation
        timeout = aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=self.timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1000))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def discover(self) -> list[ModelInfo]:
        quick = aiohttp.ClientTimeout(total=2.0)
        if self.control and await self._sleeping(quick):
            return [ModelInfo(name=n, task=self.task or "", backend=self.kind, ready=False) for n in self.serves]
        try:
            async with self.session.get(f"{self.url}/health", timeout=quick) as health:  # vLLM checks its engine here
                if health.status != 200:
                    raise BackendUnavailable(f"vLLM at {self.url} reports its engine unhealthy ({health.status})")
            async with self.session.get(f"{self.url}/v1/models", timeout=quick) as response:
                response.raise_for_status()
                data = orjson.loads(await response.read()).get("data", [])
            if self.task is None:
                self.task = await self._served_task(quick)
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
            self.task = None  # an engine that comes back may serve another model
            raise BackendUnavailable(f"vLLM at {self.url} is unreachable: {type(exc).__name__}") from exc
        return [
            ModelInfo(name=m["id"], task=self.task, backend=self.kind, ready=True,
                      extra={"max_model_len": m.get("max_model_len"), "parent": m.get("parent") or m.get("root")})
            for m in data
        ]

    async def _sleeping(self, timeout: aiohttp.ClientTimeout) -> bool:
        try:
            async with self.session.get(f"{self.control}/is_sleeping", timeout=timeout) as response:
                response.raise_for_status()
                return bool(orjson.loads(await response.read()).get("is_sleeping"))
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
            raise BackendUnavailable(f"vLLM's sleep control at {self.control} is unreachable: "
                                     f"{type(exc).__name__}") from exc

    async def load(self, model: str, timeout_s: float) -> None:
        """Wake the engine (vLLM's POST /wake_up; on a CPU, engine_control starts it). From level 2 vLLM wakes
        uninitialised weights: its sequence is the weights' memory, their reload from disk, then the KV cache."""
        if self.sleep_level == 2:
            await self._control("wake_up?tags=weights", model, timeout_s)
            await self._control("collective_rpc", model, timeout_s, {"method": "reload_weights"})
            await self._control("wake_up?tags=kv_cache", model, timeout_s)
        else:
            await self._control("wake_up", model, timeout_s)

    async def unload(self, model: str) -> None:
        """Put the engine to sleep: level 1 keeps its weights in host memory, level 2 drops them (a CPU engine stops).
        mode=wait: what it runs finishes first (vLLM's default, abort, would cut another gateway's streams)."""
        await self._control(f"sleep?level={self.sleep_level}&mode=wait", model, 120.0)

    async def _control(self, action: str, model: str, timeout_s: float, body: dict | None = None) -> None:
        try:
            async with self.session.post(f"{self.control}/{action}", json=body,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status >= 400:
                    message, _ = _error(await response.read())
                    raise BackendError(f"vLLM could not {action.split('?')[0].replace('_', ' ')} for model {model}: "
                                       f"{message[:400] or response.status}")
        except asyncio.TimeoutError as exc:
            raise BackendTimeout(f"model {model}'s engine did not {action.split('?')[0]} within {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise BackendUnavailable(f"vLLM's sleep control at {self.control} is unreachable: "
                                     f"{type(exc).__name__}") from exc

    async def _served_task(self, timeout: aiohttp.ClientTimeout) -> str:
        """vLLM mounts the routes of what its model does (its OpenAPI document lists them): a speech model (Whisper)
        gets the audio routes and no chat, a cross-encoder (pooling) the rerank routes and no chat; anything else is a
        generator."""
        async with self.session.get(f"{self.url}/openapi.json", timeout=timeout) as response:
            paths = orjson.loads(await response.read()).get("paths", {}) if response.status == 200 else {}
        if "/v1/chat/completions" not in paths:
            if "/v1/audio/transcriptions" in paths:
                return SPEECH_RECOGNITION
            if "/v1/rerank" in paths:
                return TEXT_RANKING
        return TEXT_GENERATION

    async def transcribe(self, path: str, fields: list[tuple[str, str]], audio: Upload, model: str) -> dict:
        form = aiohttp.FormData(fields)
        form.add_field("file", audio.data, filename=audio.filename, content_type=audio.content_type)
        with _mapped(model):
            async with self.session.post(f"{self.url}{path}", data=form) as response:
                content = await response.read()
        raise_for_status(response.status, content, model)
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise BackendError(f"model {model} sent an answer that is not JSON") from exc

    async def _send(self, path: str, body: dict, model: str) -> aiohttp.ClientResponse:
        if body.get("model") != model:  # an alias's target, or a fallback: the engine knows its own names only
            body = {**body, "model": model}
        with _mapped(model):
            return await self.session.post(f"{self.url}{path}", data=orjson.dumps(body), headers=_JSON)

    async def generate(self, path: str, body: dict, model: str) -> dict:
        response = await self._send(path, body, model)
        try:
            with _mapped(model):
                content = await response.read()
        finally:
            response.release()
        raise_for_status(response.status, content, model)
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise BackendError(f"model {model} sent an answer that is not JSON") from exc

    async def open_stream(self, path: str, body: dict, model: str) -> Stream:
        response = await self._send(path, body, model)
        if response.status >= 400:
            try:
                content = await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                content = b""
            response.close()
            raise_for_status(response.status, content, model)
        if path in TYPED_EVENTS_END:
            return TypedEventStream(response.content.iter_any(), response.close, model, release=response.release,
                                    ends=TYPED_EVENTS_END[path])
        return SSEStream(response.content.iter_any(), response.close, model, release=response.release)


class SSEStream(Stream):
    """vLLM's server-sent events (`data: {json}` ending with `data: [DONE]`) from `reads`, the bytes as they
    arrive; `close` drops the connection, `release` hands a connection whose answer was read to its end back to
    the pool.

    A stream that ended at [DONE] is read to the end of its HTTP body and its connection released; only one that
    did not (client gone, deadline, error) is closed, which is what aborts its generation in vLLM. Closing
    finished streams' connections too made vLLM (0.32, CPU) hold back whole answers to the requests after them,
    headers included: every stream through the gateway arrived in one piece at its end (B1s: TTFT P50 450 ms
    against nginx's 17 ms at 4 concurrent)."""

    def __init__(self, reads: AsyncIterator[bytes], close: Callable[[], None], model: str,
                 release: Callable[[], object] | None = None):
        self.reads, self._close, self.model = reads, close, model
        self._release = release
        self.closed = self.finished = False
        self._rest = b""  # an event's beginning, read before its end

    async def __aiter__(self):
        try:
            async for read in self.reads:
                chunks, done = self._take(read)
                for chunk in chunks:
                    yield chunk
                if done:
                    await self._finish()
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise StreamBroken(f"stream broke: {type(exc).__name__}") from exc
        raise StreamBroken("stream ended without [DONE]")

    async def pump(self, deliver) -> None:
        """As iterating, in one frame (no generator between the socket and the client): a read that is one token's
        event, as most are, is handed on as it came. Errors of `deliver` are its own, not the stream's."""
        reads = aiter(self.reads)
        while True:
            try:
                read = await anext(reads)
            except StopAsyncIteration:
                raise StreamBroken("stream ended without [DONE]") from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise StreamBroken(f"stream broke: {type(exc).__name__}") from exc
            if not self._rest and _one_token_event(read):
                await deliver(read, None)
                continue
            chunks, done = self._take(read)
            for chunk in chunks:
                await deliver(chunk.raw, chunk.usage)
            if done:
                await self._finish()
                return

    def _take(self, read: bytes) -> tuple[list[StreamChunk], bool]:
        """The chunks `read` completes, with what came before it, and whether vLLM's end ([DONE]) came. Token events
        are passed on as they came, together; the final usage chunk is a chunk of its own, with its usage."""
        *events, self._rest = _EVENT_END.split(self._rest + read)
        chunks: list[StreamChunk] = []
        relay: list[bytes] = []
        for event in events:
            if _token_event(event):
                relay.append(event + b"\n\n")  # passed on as it came
                continue
            payload = b"\n".join(line[5:].removeprefix(b" ") for line in _LINE_END.split(event)
                                  if line.startswith(b"data:")).strip()
            if not payload:  # a comment or a keep-alive
                continue
            if payload == b"[DONE]":
                if relay:
                    chunks.append(StreamChunk(b"".join(relay)))
                return chunks, True
            chunk = _checked(payload)
            if chunk.get("usage") and not chunk.get("choices"):  # the final usage chunk: its own event
                if relay:
                    chunks.append(StreamChunk(b"".join(relay)))
                    relay = []
                chunks.append(StreamChunk(b"data: " + payload + b"\n\n", chunk["usage"]))
            else:
                relay.append(b"data: " + payload + b"\n\n")
        if relay:
            chunks.append(StreamChunk(b"".join(relay)))
        return chunks, False

    async def _finish(self) -> None:
        try:
            async for _ in self.reads:  # the end of the chunked body, so the connection can be reused
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise StreamBroken(f"stream broke: {type(exc).__name__}") from exc
        self.finished = True

    async def aclose(self) -> None:
        self.closed = True
        if self.finished and self._release is not None:
            self._release()
        else:
            self._close()  # also what aborts the generation in vLLM when the client left


# The APIs whose streams are typed events (`event: <type>` beside `data: {"type": <type>, ...}`), and the events that
# end them: the Responses API's (OpenAI's) and the Messages API's (Anthropic's). Neither sends [DONE].
TYPED_EVENTS_END = {"/v1/responses": frozenset({"response.completed", "response.incomplete", "response.failed"}),
                    "/v1/messages": frozenset({"message_stop"})}


class TypedEventStream(SSEStream):
    """A Responses or Messages stream: each event relayed as vLLM sent it (its `event:` line too) and parsed, for its
    usage (the Responses API's in its last event's response, Anthropic's input tokens in message_start and output
    tokens in message_delta: merged, and handed over with the last event) and for an error (which ends the stream as
    broken). It ends at one of `ends`."""

    def __init__(self, reads, close, model: str, *, ends: frozenset[str], release=None):
        super().__init__(reads, close, model, release)
        self.ends = ends

    pump = Stream.pump  # every event is parsed: the chunks as iterating gives them

    async def __aiter__(self):
        rest, usage = b"", {}
        try:
            async for read in self.reads:
                *events, rest = _EVENT_END.split(rest + read)
                relay: list[bytes] = []
                for event in events:
                    payload = b"\n".join(line[5:].removeprefix(b" ") for line in _LINE_END.split(event)
                                          if line.startswith(b"data:")).strip()
                    if not payload:  # a comment or a keep-alive
                        continue
                    chunk = _checked(payload)
                    if chunk.get("type") == "error":
                        raise StreamBroken(f"error in stream: {str(chunk)[:300]}")
                    relay.append(event + b"\n\n")
                    found = chunk.get("usage") or (chunk.get("response") or {}).get("usage") or \
                        (chunk.get("message") or {}).get("usage")
                    if isinstance(found, dict):
                        usage.update(found)
                    if chunk.get("type") in self.ends:
                        yield StreamChunk(b"".join(relay), usage)
                        async for _ in self.reads:  # the end of the chunked body, so the connection can be reused
                            pass
                        self.finished = True
                        return
                if relay:
                    yield StreamChunk(b"".join(relay))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise StreamBroken(f"stream broke: {type(exc).__name__}") from exc
        raise StreamBroken("stream ended before its last event")


def _token_event(event: bytes) -> bool:
    """An event (its blank line cut off) that is one token's, passed on as vLLM sent it: `data: {"id":...}` on one
    line, without usage."""
    return event.startswith(b'data: {"id":') and b'"usage"' not in event and b"\n" not in event and b"\r" not in event


def _one_token_event(read: bytes) -> bool:
    """`read` is one token's event, whole, and nothing else (the blank line that ends it included)."""
    return read.endswith(b"\n\n") and _token_event(read[:-2])


def _checked(payload: bytes) -> dict:
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise StreamBroken("unparsable stream chunk") from None
    if not isinstance(chunk, dict) or "error" in chunk:
        raise StreamBroken(f"error in stream: {str(chunk.get('error') if isinstance(chunk, dict) else chunk)[:300]}")
    return chunk

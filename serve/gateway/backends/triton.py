"""Triton client for the gateway: gRPC (aio) on the hot path, model discovery via model configs.

An entry is servable when its config carries `rtxserve_task` (written by `rtxserve export`); other
models in the repository (the ensemble's tokenizer / model / postprocess steps) are not exposed.

Coalescing (classify, embeddings, NER): at most `coalesce_calls` Triton calls are out per model and call shape. A
batch that arrives while they are busy waits, and when one returns, every batch waiting leaves together as one call
(whole batches, up to the model's max_batch_size). At low load nothing waits; under load the gateway's gRPC call and
Triton's per-request work are paid once for several requests (B1 in ../shared/BENCH.md: at 8 in flight on 2 cores,
3.5 requests per call). Each request still gets its own rows, and its own error: when Triton refuses a coalesced
call's input, each batch is sent again alone, so only the request with the bad input hears of it. A model with Triton's
response cache is not coalesced: the cache keys a call by its whole input, so requests go one by one, and Triton's
batcher merges the misses (B9).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import sys
from collections import deque
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import (InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor,
                                triton_to_np_dtype)

from core import contract

from ..exceptions import (
    BackendConnectFailed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidRequest,
)
from ..metrics import CALL_REQUESTS
from .base import Backend, Classification, Detections, Embedding, ModelInfo, Tagging

log = logging.getLogger("rtxserve.gateway.triton")

# Triton gRPC status -> how the gateway answers. Queue full is RESOURCE_EXHAUSTED/UNAVAILABLE: 503.
_NOT_CONNECTED = ("failed to connect", "Connection refused")
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_UNAVAILABLE = {"StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED", "StatusCode.NOT_FOUND", "StatusCode.CANCELLED"}


def _raise_mapped(exc: InferenceServerException, model: str) -> None:
    status = str(exc.status() or "")
    log.warning("triton %s: %s %s", model, status, exc.message())
    if status == "StatusCode.DEADLINE_EXCEEDED" or "Deadline Exceeded" in str(exc.message()):
        raise BackendTimeout(f"model {model} did not answer within the deadline") from exc
    if status == "StatusCode.UNAVAILABLE" and any(s in str(exc.message()) for s in _NOT_CONNECTED):
        raise BackendConnectFailed(f"model {model} is not reachable; retry shortly") from exc  # nothing was sent
    if status in _UNAVAILABLE or not status:
        raise BackendUnavailable(f"model {model} is not available right now; retry shortly") from exc
    if status == "StatusCode.INVALID_ARGUMENT":
        # Our pre-processing models say what is wrong with an input (e.g. an undecodable image): pass that on.
        detail = re.sub(r"^in ensemble '[^']*', ", "", str(exc.message() or ""))[:300]
        raise InvalidRequest(f"model {model} rejected the input" + (f": {detail}" if detail else "")) from exc
    raise BackendError(f"model {model} failed to process the request") from exc


@dataclass
class _Line:
    """One model's calls of one shape (outputs, input, parameters): the batches waiting, the calls out."""

    waiting: deque = field(default_factory=deque)  # (texts, future, deadline) in arrival order
    in_flight: int = 0


class TritonBackend(Backend):
    kind = "triton"
    swaps = True  # through the repository API, where tritonserver runs in explicit model-control mode

    def __init__(self, grpc_url: str, coalesce_calls: int = 1):
        self.url = grpc_url
        self.client: grpcclient.InferenceServerClient | None = None
        self._configs: dict[tuple[str, str], dict] = {}
        self._last_config: dict[str, dict] = {}  # name -> its config when last loaded: an unloaded entry keeps its task
        self.coalesce_calls = coalesce_calls  # calls in flight per call shape before batches wait; 0: off
        self._lines: dict[tuple, _Line] = {}  # per call shape: batches waiting, calls in flight
        self._sending: set[asyncio.Task] = set()  # coalesced calls in flight (held: the loop keeps weak references)

    async def start(self) -> None:
        self.client = grpcclient.InferenceServerClient(self.url)  # discovery and configs
        self._channel = grpc.aio.insecure_channel(self.url, options=_CHANNEL_OPTIONS)  # inference
        self._infer = self._channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString)

    async def close(self) -> None:
        for task in self._sending:
            task.cancel()
        if self.client is not None:
            await self.client.close()
            await self._channel.close()

    async def discover(self) -> list[ModelInfo]:
        try:
            if not await self.client.is_server_ready(client_timeout=2.0):
                raise BackendUnavailable("Triton is not ready")
            index = await self.client.get_model_repository_index(as_json=True, client_timeout=2.0)
            models = []
            for entry in index.get("models", []):
                config = await self._config(entry)
                info = self._model_info(entry, config)
                if info is not None:
                    models.append(info)
            return models
        except InferenceServerException as exc:
            raise BackendUnavailable(f"Triton at {self.url} is unreachable: {exc.message()}") from exc

    async def _config(self, entry: dict) -> dict | None:
        """A model's config, fetched once per (name, version) when it is ready, cached after."""
        key = (entry["name"], entry.get("version", ""))
        if key not in self._configs and entry.get("state") == "READY":
            response = await self.client.get_model_config(entry["name"], as_json=True, client_timeout=2.0)
            self._configs[key] = self._last_config[entry["name"]] = response.get("config", {})
        return self._configs.get(key) or self._last_config.get(entry["name"])

    def _model_info(self, entry: dict, config: dict | None) -> ModelInfo | None:
        """The entry as the gateway routes to it; None for a step of an ensemble (no task in its config). An entry
        never loaded has no config to read: it is listed not ready, its task "" (explicit model control)."""
        if config is None and entry.get("state") != "READY":
            return ModelInfo(name=entry["name"], task="", backend=self.kind, ready=False)
        params = {k: v.get("string_value", "") for k, v in (config or {}).get("parameters", {}).items()}
        task = params.get(contract.PARAM_TASK)
        if not task:
            return None
        return ModelInfo(
            name=entry["name"],
            task=task,
            backend=self.kind,
            ready=entry.get("state") == "READY",
            labels=tuple(json.loads(params.get(contract.PARAM_LABELS, "[]"))),
            max_batch_size=int(config.get("max_batch_size", 0) or 0),
            dimensions=int(params.get(contract.PARAM_DIMENSIONS) or 0),
            response_cache=bool((config.get("response_cache") or {}).get("enable")),
            extra={k: params[p] for k, p in (("aggregation", contract.PARAM_AGGREGATION), ("defaults", contract.PARAM_DEFAULTS))
                   if p in params},
        )

    async def load(self, model: str, timeout_s: float) -> None:
        """Triton's repository API: the entry and, an ensemble, its steps (what its config names)."""
        try:
            await self.client.load_model(model, client_timeout=timeout_s)
        except InferenceServerException as exc:
            detail = str(exc.message() or exc)
            if "DEADLINE" in str(exc.status()) or "Deadline" in detail:
                raise BackendTimeout(f"model {model} did not load within {timeout_s:g} s") from exc
            raise BackendError(f"Triton could not load model {model}: {detail[:400]}") from exc

    async def unload(self, model: str) -> None:
        """Triton unloads an entry once the requests it runs are answered; its ensemble's steps go with it."""
        try:
            await self.client.unload_model(model, unload_dependents=True, client_timeout=30.0)
        except InferenceServerException as exc:
            raise BackendError(f"Triton could not unload model {model}: {exc.message()}") from exc

    async def classify(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Classification]:
        return await self._in_chunks(self._classify_chunk, model, texts, timeout_s)

    async def classify_images(self, model: ModelInfo, images: list[bytes], timeout_s: float) -> list[Classification]:
        return await self._in_chunks(self._classify_chunk, model, images, timeout_s, "IMAGE")

    async def embed(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Embedding]:
        return await self._in_chunks(self._embed_chunk, model, texts, timeout_s)

    async def tag(self, model: ModelInfo, texts: list[str], aggregation: str, timeout_s: float) -> list[Tagging]:
        return await self._in_chunks(self._tag_chunk, model, texts, timeout_s, aggregation)

    async def _in_chunks(self, infer_chunk, model: ModelInfo, texts: list[str], timeout_s: float, *args) -> list:
        """Triton rejects batches over max_batch_size: split, run the chunks concurrently, keep the order."""
        size = model.max_batch_size or len(texts)
        if len(texts) <= size:
            return await infer_chunk(model, texts, timeout_s, *args)  # one call: no task to gather
        chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
        parts = await asyncio.gather(*(infer_chunk(model, chunk, timeout_s, *args) for chunk in chunks))
        return [r for part in parts for r in part]

    async def _send(self, model: ModelInfo, request, outputs: tuple[str, ...], timeout_s: float) -> dict:
        """Ask `request` for `outputs`, send it, map Triton's errors: output name -> (its metadata, its raw bytes)."""
        for name in outputs:
            request.outputs.add(name=name)
        try:
            response = await self._infer(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            _raise_mapped(InferenceServerException(exc.details(), status=str(exc.code())), model.name)
        return {meta.name: (meta, raw) for meta, raw in zip(response.outputs, response.raw_output_contents)}

    async def _infer_texts(self, model: ModelInfo, texts: list[str | bytes], outputs: tuple[str, ...], timeout_s: float,
                           parameters: dict | None = None, input_name: str = "TEXT"):
        """One batch of texts (or encoded images) as `input_name` [n, 1], errors mapped; the named outputs as
        arrays with n rows. Sent at once while a call is free, else coalesced with the others waiting (module doc)."""
        call = (model, outputs, timeout_s, parameters, input_name)
        # Off, or nothing could share a call, or Triton caches the model's answers: its cache looks a call up whole
        # (before its own batcher merges the misses), and a coalesced call's mix of requests is never seen twice.
        if not self.coalesce_calls or model.max_batch_size == 1 or model.response_cache:
            return await self._infer_now(texts, *call)
        key = (model.name, outputs, input_name, tuple(sorted((parameters or {}).items())))
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = _Line()
        if line.in_flight < self.coalesce_calls and not line.waiting:  # a free call and nobody before it: go now
            line.in_flight += 1
            _call_requests(model.name).observe(1)
            try:
                return await self._infer_now(texts, *call)
            finally:
                self._call_done(line, call)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        line.waiting.append((texts, future, loop.time() + timeout_s))
        try:  # the deadline counts from arrival: time spent waiting for a call is part of it
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise BackendTimeout(f"model {model.name} did not answer within the deadline") from None

    def _flush(self, line: "_Line", call: tuple) -> None:
        """Send what waits, as calls of at most max_batch_size rows (whole batches each), while calls are free."""
        limit = call[0].max_batch_size or sys.maxsize
        while line.waiting and line.in_flight < self.coalesce_calls:
            group, rows = [], 0
            while line.waiting and (not group or rows + len(line.waiting[0][0]) <= limit):
                item = line.waiting.popleft()
                if not item[1].done():  # a cancelled request is not sent
                    group.append(item)
                    rows += len(item[0])
            if group:
                line.in_flight += 1
                task = asyncio.ensure_future(self._send_group(group, call))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)
                task.add_done_callback(lambda _, line=line: self._call_done(line, call))

    def _call_done(self, line: "_Line", call: tuple) -> None:
        """A call returned: what waited for it leaves now."""
        line.in_flight -= 1
        if line.waiting:
            self._flush(line, call)

    async def _send_group(self, group: list, call: tuple) -> None:
        _call_requests(call[0].name).observe(len(group))
        model, outputs, _, parameters, input_name = call
        timeout_s = max(deadline for _, _, deadline in group) - asyncio.get_running_loop().time()  # the latest one's
        try:
            arrays = await self._infer_now([t for texts, _, _ in group for t in texts], model, outputs, timeout_s,
                                           parameters, input_name)
        except InvalidRequest as exc:
            if len(group) == 1:
                _settle(group[0][1], error=exc)
            else:  # one input was refused: each batch on its own, so that only its sender hears why
                await asyncio.gather(*(self._send_group([item], call) for item in group))
            return
        except asyncio.CancelledError:  # the gateway is closing: nobody is left waiting
            for _, future, _ in group:
                future.cancel()
            raise
        except Exception as exc:  # unavailable, timed out, failed: the same for every batch of the call
            for _, future, _ in group:
                _settle(future, error=exc)
            return
        start = 0
        for texts, future, _ in group:
            _settle(future, [array[start:start + len(texts)] for array in arrays])
            start += len(texts)

    async def _infer_now(self, texts: list[str | bytes], model: ModelInfo, outputs: tuple[str, ...], timeout_s: float,
                         parameters: dict | None, input_name: str):
        """`_infer_texts` as one call. The request goes straight to Triton's generated gRPC stub: tritonclient's
        wrapper objects cost a third more CPU per call (0.31 against 0.23 CPU-ms, measured side by side)."""
        request = service_pb2.ModelInferRequest(model_name=model.name)
        request.inputs.add(name=input_name, datatype="BYTES", shape=(len(texts), 1))
        data = np.array([t.encode("utf-8") if isinstance(t, str) else t for t in texts], dtype=np.object_)
        request.raw_input_contents.append(serialize_byte_tensor(data).item())  # as tritonclient does
        for key, value in (parameters or {}).items():
            request.parameters[key].string_param = value
        found = {}
        for meta, raw in (await self._send(model, request, outputs, timeout_s)).values():
            if meta.datatype == "BYTES":
                array = deserialize_bytes_tensor(raw)
            else:
                array = np.frombuffer(raw, dtype=triton_to_np_dtype(meta.datatype))
            shape = tuple(meta.shape)
            found[meta.name] = array.reshape(shape) if array.size == math.prod(shape) else None
        arrays = [found.get(n) for n in outputs]
        for name, array in zip(outputs, arrays):
            if array is None or len(array) != len(texts):
                rows = 0 if array is None else len(array)
                raise BackendError(f"model {model.name} returned {rows} {name} rows for {len(texts)} inputs")
        return arrays

    async def _classify_chunk(self, model: ModelInfo, texts: list[str | bytes], timeout_s: float,
                              input_name: str = "TEXT") -> list[Classification]:
        labels, scores, probs = await self._infer_texts(model, texts, ("LABEL", "SCORE", "PROBS"), timeout_s,
                                                        input_name=input_name)
        return [
            Classification(
                label=labels[i, 0].decode("utf-8"),
                score=float(scores[i, 0]),
                scores={name: float(p) for name, p in zip(model.labels, probs[i])},
            )
            for i in range(len(texts))
        ]

    async def _embed_chunk(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Embedding]:
        vectors, tokens = await self._infer_texts(model, texts, ("EMBEDDINGS", "TOKENS"), timeout_s)
        vectors = vectors.astype(np.float32, copy=False).reshape(len(texts), -1)
        if model.dimensions and vectors.shape[1] != model.dimensions:
            size = vectors.shape[1]
            raise BackendError(f"model {model.name} returned vectors of size {size}, not {model.dimensions}")
        if not np.isfinite(vectors).all():  # NaN/inf cannot be sent as JSON and is no embedding anyway
            raise BackendError(f"model {model.name} returned non-finite values")
        return [Embedding(vectors[i], int(n)) for i, n in enumerate(tokens.reshape(len(texts)))]

    async def _tag_chunk(self, model: ModelInfo, texts: list[str], timeout_s: float, aggregation: str) -> list[Tagging]:
        # The postprocess step reads the strategy from the request parameters (the ensemble passes them on).
        (rows,) = await self._infer_texts(model, texts, ("ENTITIES",), timeout_s, {"aggregation": aggregation})
        results = []
        for row in rows.reshape(len(texts)):
            try:
                item = json.loads(row)
                results.append(Tagging(list(item["entities"]), bool(item["truncated"]), int(item["tokens"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise BackendError(f"model {model.name} returned entities the gateway cannot read") from exc
        return results

    async def detect(self, model: ModelInfo, images: list[bytes], options: tuple[float, float, int],
                     timeout_s: float) -> list[Detections]:
        """One request per image (a detector's images keep their own sizes, so they do not batch in one request),
        sent together; Triton's dynamic batcher may still group equal sizes. An image the model refuses is named."""
        async def one(i: int, image: bytes) -> Detections:
            try:
                return await self._detect_one(model, image, options, timeout_s)
            except InvalidRequest as exc:
                raise InvalidRequest(f"image {i}: {exc.message}", param="input") from None

        return list(await asyncio.gather(*(one(i, image) for i, image in enumerate(images))))

    async def _detect_one(self, model: ModelInfo, image: bytes, options: tuple[float, float, int],
                          timeout_s: float) -> Detections:
        request = service_pb2.ModelInferRequest(model_name=model.name)
        request.inputs.add(name="IMAGE", datatype="BYTES", shape=(1, 1))
        request.raw_input_contents.append(serialize_byte_tensor(np.array([image], dtype=np.object_)).item())
        request.inputs.add(name="OPTIONS", datatype="FP32", shape=(1, 3))
        request.raw_input_contents.append(np.array([options], dtype=np.float32).tobytes())
        found = await self._send(model, request, ("DETECTIONS", "IMAGE_SIZE"), timeout_s)
        try:
            meta, raw = found["DETECTIONS"]
            rows = np.frombuffer(raw, dtype=np.float32).reshape(tuple(meta.shape))[0]
            height, width = (int(v) for v in np.frombuffer(found["IMAGE_SIZE"][1], dtype=np.int64)[:2])
        except (KeyError, ValueError, IndexError) as exc:
            raise BackendError(f"model {model.name} returned detections the gateway cannot read") from exc
        return Detections(rows[rows[:, 4] >= 0], width, height)  # rows padded with score -1 within a batch

    async def generate_images(self, model: ModelInfo, params: dict, timeout_s: float) -> tuple[list[bytes], int]:
        request = service_pb2.ModelInferRequest(model_name=model.name)
        tensors = (("PROMPT", "BYTES", params["prompt"]), ("NEGATIVE_PROMPT", "BYTES", params["negative_prompt"]),
                   ("STEPS", "INT32", params["steps"]), ("GUIDANCE", "FP64", params["guidance"]),
                   ("SEED", "INT64", params["seed"]), ("WIDTH", "INT32", params["width"]),
                   ("HEIGHT", "INT32", params["height"]), ("N", "INT32", params["n"]),
                   ("SCHEDULER", "BYTES", params["scheduler"]), ("LORA_SCALE", "FP64", params["lora_scale"]))
        for name, datatype, value in tensors:
            request.inputs.add(name=name, datatype=datatype, shape=(1,))
            if datatype == "BYTES":
                raw = serialize_byte_tensor(np.array([value.encode("utf-8")], dtype=np.object_)).item()
            else:
                raw = np.array([value], dtype=triton_to_np_dtype(datatype)).tobytes()
            request.raw_input_contents.append(raw)
        found = await self._send(model, request, ("IMAGES", "PROMPT_TRUNCATED"), timeout_s)
        if "IMAGES" not in found:
            raise BackendError(f"model {model.name} returned no images")
        images = [bytes(b) for b in deserialize_bytes_tensor(found["IMAGES"][1]).reshape(-1)]
        if len(images) != params["n"] or not all(i.startswith(b"\x89PNG") for i in images):
            raise BackendError(f"model {model.name} returned {len(images)} images (not all PNG) for {params['n']} asked")
        truncated = int(np.frombuffer(found["PROMPT_TRUNCATED"][1], dtype=np.int32)[0]) if "PROMPT_TRUNCATED" in found else 0
        return images, truncated


@functools.lru_cache(maxsize=256)
def _call_requests(model: str):
    return CALL_REQUESTS.labels(model)


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # its request was cancelled (client gone) while the call was out
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

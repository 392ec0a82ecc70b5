"""A fake Triton backend for in-process gateway tests (ASGI, no sockets), and the error-shape check
every gateway test applies."""

import asyncio
import json
import threading
from collections import Counter

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, np_to_triton_dtype, serialize_byte_tensor

from serve.gateway.backends.base import Backend, Classification, Embedding, ModelInfo, Tagging
from serve.gateway.exceptions import BackendUnavailable

LABELS = ("neg", "pos")
DIM = 4
MODELS = (ModelInfo("clf", "text-classification", "triton", True, LABELS, 4),
          ModelInfo("emb", "feature-extraction", "triton", True, (), 4, DIM),
          ModelInfo("ner", "token-classification", "triton", True, ("O", "B-PER", "I-PER"), 4, extra={"aggregation": "first"}),
          ModelInfo("vit", "image-classification", "triton", True, ("cat", "dog"), 4))


def vector(text: str) -> np.ndarray:
    """A distinct vector per text, with values that float32 does not hold exactly (so precision is tested)."""
    return (np.arange(DIM, dtype=np.float32) + len(text)) / np.float32(3)


class FakeTriton(Backend):
    """Serves `models`; records the texts of each call answered (`calls`) and of each call failed (`failed`); `up` and
    `fail_with` simulate outages."""

    kind = "triton"

    def __init__(self, models=MODELS, url="fake"):
        self.url = url
        self.models = list(models)
        self.up = True
        self.calls: list[list[str]] = []
        self.failed: list[list[str]] = []
        self.fail_with: Exception | None = None

    async def discover(self):
        if not self.up:
            raise BackendUnavailable("down")
        return self.models

    def _record(self, texts):
        if self.fail_with:
            self.failed.append(texts)
            raise self.fail_with
        self.calls.append(texts)

    async def classify(self, model, texts, timeout_s):
        self._record(texts)
        return [Classification("pos" if "good" in t else "neg", 0.9, {"neg": 0.1, "pos": 0.9}) for t in texts]

    async def classify_images(self, model, images, timeout_s):
        """PNGs are cats, JPEGs dogs."""
        self._record(images)
        return [Classification("cat", 0.8, {"cat": 0.8, "dog": 0.2}) if i.startswith(b"\x89PNG")
                else Classification("dog", 0.7, {"cat": 0.3, "dog": 0.7}) for i in images]

    async def embed(self, model, texts, timeout_s):
        self._record(texts)
        return [Embedding(vector(t), len(t.split())) for t in texts]

    async def tag(self, model, texts, aggregation, timeout_s):
        self._record(texts)
        self.aggregations = [*getattr(self, "aggregations", []), aggregation]
        return [Tagging(capitalised(t), len(t) > 40, len(t.split()) + 2) for t in texts]


class GatedTriton(FakeTriton):
    """Holds each classify call while `gate` is closed (`gate.clear()`; open at first, for the start's canaries), so
    that a test knows which requests hold a slot instead of guessing from how long they take; `holding` counts the
    calls held now."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.holding = 0
        self.held: Counter[str] = Counter()  # the calls held now, by model

    async def classify(self, model, texts, timeout_s):
        self.holding += 1
        self.held[model.name] += 1
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
        finally:
            self.holding -= 1
            self.held[model.name] -= 1
        return await super().classify(model, texts, timeout_s)


class SlowTriton(FakeTriton):
    """Takes `delay_s` per classify call, so that requests overlap."""

    def __init__(self, delay_s: float, **kwargs):
        super().__init__(**kwargs)
        self.delay_s = delay_s

    async def classify(self, model, texts, timeout_s):
        await asyncio.sleep(self.delay_s)
        return await super().classify(model, texts, timeout_s)


def capitalised(text: str) -> list[dict]:
    """Fake entities: every capitalised word is a PER."""
    out, pos = [], 0
    for word in text.split():
        start = text.index(word, pos)
        pos = start + len(word)
        if word[:1].isupper():
            out.append({"entity_group": "PER", "score": 0.75, "start": start, "end": pos, "word": word})
    return out


def request_inputs(request) -> tuple[str, list[bytes]]:
    """The one BYTES input of a ModelInferRequest: its name and its items."""
    (tensor,) = request.inputs
    items = list(deserialize_bytes_tensor(request.raw_input_contents[0]))
    assert list(tensor.shape) == [len(items), 1] and tensor.datatype == "BYTES"
    return tensor.name, items


def infer_response(request, arrays: dict) -> service_pb2.ModelInferResponse:
    """Triton's answer to `request`: the outputs it asked for, from `arrays`, as raw contents."""
    response = service_pb2.ModelInferResponse(model_name=request.model_name)
    for wanted in request.outputs:
        array = arrays[wanted.name]
        byte_tensor = array.dtype == np.object_
        response.outputs.add(name=wanted.name, shape=array.shape,
                             datatype="BYTES" if byte_tensor else np_to_triton_dtype(array.dtype))
        response.raw_output_contents.append(serialize_byte_tensor(array).item() if byte_tensor else array.tobytes())
    return response


class FakeGrpc:
    """Stands in for the gateway's ModelInfer call on Triton's gRPC stub: answers TEXT [n, 1] with, per row,
    a vector whose first value is the text's length, a classification whose label is that length, and the
    `capitalised` entities as the NER postprocess's JSON (`entities_json=False`: unreadable bytes).
    Records each batch's size and request parameters."""

    def __init__(self, rows_short_by: int = 0, entities_json: bool = True):
        self.batches: list[int] = []
        self.parameters: list[dict | None] = []
        self.rows_short_by = rows_short_by
        self.entities_json = entities_json

    async def __call__(self, request, timeout):
        name, texts = request_inputs(request)
        assert name == "TEXT"
        self.batches.append(len(texts))
        self.parameters.append({k: v.string_param for k, v in request.parameters.items()} or None)
        n = len(texts) - self.rows_short_by
        vectors = np.zeros((n, DIM), dtype=np.float32)
        vectors[:, 0] = [len(t) for t in texts[:n]]
        entities = [json.dumps({"entities": capitalised(t.decode()), "truncated": False, "tokens": 3}).encode()
                    if self.entities_json else b"not json" for t in texts[:n]]
        return infer_response(request, {
            "EMBEDDINGS": vectors,
            "TOKENS": np.full((n, 1), 2, dtype=np.int64),
            "LABEL": np.array([[str(len(t)).encode()] for t in texts[:n]], dtype=np.object_),
            "SCORE": np.ones((n, 1), dtype=np.float32),
            "PROBS": np.ones((n, 1), dtype=np.float32),
            "ENTITIES": np.array(entities, dtype=np.object_).reshape(-1, 1),
        })


def error_of(response, status):
    """The OpenAI-shaped error body of `response`, after checking its status and that nothing leaked."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and "/work" not in response.text
    return body["error"]


class SwappingTriton(GatedTriton):
    """Serves MODELS always, and loads `on_demand` (copies of the classifier under other names) when asked: `loads`
    and `unloads` list the calls in order; a load waits while `load_gate` is closed and raises `load_fails[model]` where set;
    the next `discover_misses` discoveries fail as a busy server's do."""

    swaps = True

    def __init__(self, on_demand: tuple[str, ...], **kwargs):
        super().__init__(**kwargs)
        self.on_demand = on_demand
        self.loaded: set[str] = set()
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.unloaded_under: list[int] = []  # per unload, the model's calls held at that moment (never any, we hope)
        self.load_gate = threading.Event()
        self.load_gate.set()
        self.load_fails: dict[str, Exception] = {}
        self.discover_misses = 0

    async def discover(self):
        if self.discover_misses:
            self.discover_misses -= 1
            raise BackendUnavailable("Triton is unreachable: TimeoutError")
        found = await super().discover()
        return [*found, *(ModelInfo(n, "text-classification", "triton", True, LABELS, 4) if n in self.loaded
                          else ModelInfo(n, "", "triton", False) for n in self.on_demand)]

    async def load(self, model, timeout_s):
        self.loads.append(model)
        while not self.load_gate.is_set():
            await asyncio.sleep(0.005)
        if model in self.load_fails:
            raise self.load_fails[model]
        self.loaded.add(model)

    async def unload(self, model):
        self.unloads.append(model)
        self.unloaded_under.append(self.held[model])
        self.loaded.discard(model)

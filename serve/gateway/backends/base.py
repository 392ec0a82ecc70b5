"""The interface every backend client implements: every call the gateway makes goes through it, so the
gateway needs no isinstance checks and no backend-specific methods."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ModelInfo:
    """A model the gateway can route to, as the backend describes it."""

    name: str
    task: str
    backend: str
    ready: bool
    labels: tuple[str, ...] = ()
    max_batch_size: int = 0
    dimensions: int = 0  # embedding size of a feature-extraction model; 0: not known
    response_cache: bool = False  # Triton answers a repeated request from its response cache (never coalesced)
    extra: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Classification:
    label: str
    score: float
    scores: dict[str, float]


@dataclass(frozen=True, eq=False)  # == on ndarrays is elementwise, so identity it is
class Embedding:
    """One text's vector (float32, 1-D, pooled and normalised by the model) and its token count after truncation."""

    vector: np.ndarray
    tokens: int


@dataclass(frozen=True)
class Tagging:
    """One text's entities (dicts as the NER postprocess model makes them), whether its tail was cut off,
    and its token count."""

    entities: list[dict]
    truncated: bool
    tokens: int


@dataclass(frozen=True, eq=False)
class Detections:
    """One image's detections, best first: rows of (x1, y1, x2, y2, score, class id) in its pixels, and its size."""

    rows: np.ndarray
    width: int
    height: int


@dataclass(frozen=True)
class StreamChunk:
    """What a streamed generation relays at once: one or more SSE events as the backend sent them, and, for the
    final usage chunk (usage, no choices: always an event of its own), that usage."""

    raw: bytes
    usage: dict | None = None


class StreamBroken(Exception):
    """A stream ended before its end marker: the backend died, reset, or sent an error or garbage."""


class Stream(ABC):
    """A generation being streamed. Iterating yields its chunks and ends normally only at the backend's end
    marker; otherwise StreamBroken is raised. Closing it (client gone, deadline) aborts the generation."""

    @abstractmethod
    def __aiter__(self) -> AsyncIterator[StreamChunk]: ...

    @abstractmethod
    async def aclose(self) -> None: ...

    def first_chunk(self) -> None:  # noqa: B027 - a hook for the wrappers that wait for it (fleet/dispatch.py)
        """Called once by what relays the stream, at its first chunk."""

    async def pump(self, deliver: Callable[[bytes, dict | None], Awaitable[None]]) -> None:
        """Each chunk handed to `deliver` (its bytes, and a final usage chunk's usage) as it comes, ending as iterating
        does. What relays a stream to its client calls this: a backend's stream may do it in fewer steps."""
        async for chunk in self:
            await deliver(chunk.raw, chunk.usage)


class Backend(ABC):
    kind: str = ""
    url: str = ""
    swaps: bool = False  # loads and unloads its models on request (load / unload): on-demand models live here

    @property
    def name(self) -> str:
        """One replica among several of its kind: kind@address."""
        return f"{self.kind}@{self.url}"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections (called once, inside the event loop)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close connections."""

    @abstractmethod
    async def discover(self) -> list[ModelInfo]:
        """The models this backend serves, with readiness. Raises BackendUnavailable if unreachable. A backend that
        swaps also lists the models it could load, not ready, with the task "" where it cannot tell it yet."""

    async def load(self, model: str, timeout_s: float) -> None:
        """Load `model` (swapping backends); raises BackendError saying why it could not."""
        raise NotImplementedError(f"{self.kind} backends do not load models on demand")

    async def unload(self, model: str) -> None:
        """Unload `model` once the requests it is running are answered (swapping backends)."""
        raise NotImplementedError(f"{self.kind} backends do not unload models on demand")

    async def classify(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Classification]:
        raise NotImplementedError(f"{self.kind} backends do not serve text classification")

    async def classify_images(self, model: ModelInfo, images: list[bytes], timeout_s: float) -> list[Classification]:
        raise NotImplementedError(f"{self.kind} backends do not serve image classification")

    async def embed(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Embedding]:
        raise NotImplementedError(f"{self.kind} backends do not serve embeddings")

    async def tag(self, model: ModelInfo, texts: list[str], aggregation: str, timeout_s: float) -> list[Tagging]:
        raise NotImplementedError(f"{self.kind} backends do not serve token classification")

    async def detect(self, model: ModelInfo, images: list[bytes], options: tuple[float, float, int],
                     timeout_s: float) -> list[Detections]:
        """Each encoded image's detections; `options` (conf, iou, max_det)."""
        raise NotImplementedError(f"{self.kind} backends do not serve object detection")

    async def generate_images(self, model: ModelInfo, params: dict, timeout_s: float) -> tuple[list[bytes], int]:
        """PNG images for a text-to-image request (`params` as image_generation/serving.py makes them), and the count of
        prompt tokens the text encoder could not take."""
        raise NotImplementedError(f"{self.kind} backends do not serve image generation")

    async def generate(self, path: str, body: dict, model: str) -> dict:
        """An OpenAI generation request (`path` /v1/chat/completions or /v1/completions), answered whole."""
        raise NotImplementedError(f"{self.kind} backends do not serve generation")

    async def open_stream(self, path: str, body: dict, model: str) -> Stream:
        """Start a streamed generation; errors before the first chunk raise like `generate`."""
        raise NotImplementedError(f"{self.kind} backends do not serve generation")

    async def transcribe(self, path: str, fields: list[tuple[str, str]], audio: "Upload", model: str) -> dict:
        """An OpenAI audio request (`path` /v1/audio/transcriptions or /v1/audio/translations): the form `fields`
        and the audio file, relayed as a multipart form; the backend's JSON answer."""
        raise NotImplementedError(f"{self.kind} backends do not serve speech to text")


@dataclass(frozen=True, eq=False)
class Upload:
    """An uploaded file as the client sent it: its bytes, file name and content type."""

    data: bytes
    filename: str
    content_type: str

"""The interface every backend client implements (Triton now, vLLM next)."""

from __future__ import annotations

from abc import ABC, abstractmethod
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


class Backend(ABC):
    kind: str = ""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections (called once, inside the event loop)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close connections."""

    @abstractmethod
    async def discover(self) -> list[ModelInfo]:
        """The models this backend serves, with readiness. Raises BackendUnavailable if unreachable."""

    async def classify(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Classification]:
        raise NotImplementedError(f"{self.kind} backends do not serve text classification")

    async def classify_images(self, model: ModelInfo, images: list[bytes], timeout_s: float) -> list[Classification]:
        raise NotImplementedError(f"{self.kind} backends do not serve image classification")

    async def embed(self, model: ModelInfo, texts: list[str], timeout_s: float) -> list[Embedding]:
        raise NotImplementedError(f"{self.kind} backends do not serve embeddings")

    async def tag(self, model: ModelInfo, texts: list[str], aggregation: str, timeout_s: float) -> list[Tagging]:
        raise NotImplementedError(f"{self.kind} backends do not serve token classification")

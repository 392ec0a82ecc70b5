"""A fake Triton backend for in-process gateway tests (ASGI, no sockets), and the error-shape check
every gateway test applies."""

import numpy as np

from serve.backends.base import Backend, Classification, Embedding, ModelInfo
from serve.exceptions import BackendUnavailable

LABELS = ("neg", "pos")
DIM = 4
MODELS = (ModelInfo("clf", "text-classification", "triton", True, LABELS, 4),
          ModelInfo("emb", "feature-extraction", "triton", True, (), 4, DIM))


def vector(text: str) -> np.ndarray:
    """A distinct vector per text, with values that float32 does not hold exactly (so precision is tested)."""
    return (np.arange(DIM, dtype=np.float32) + len(text)) / np.float32(3)


class FakeTriton(Backend):
    """Serves `models`; records the texts of each call; `up` and `fail_with` simulate outages."""

    kind = "triton"

    def __init__(self, models=MODELS):
        self.models = list(models)
        self.up = True
        self.calls: list[list[str]] = []
        self.fail_with: Exception | None = None

    async def discover(self):
        if not self.up:
            raise BackendUnavailable("down")
        return self.models

    def _record(self, texts):
        if self.fail_with:
            raise self.fail_with
        self.calls.append(texts)

    async def classify(self, model, texts, timeout_s):
        self._record(texts)
        return [Classification("pos" if "good" in t else "neg", 0.9, {"neg": 0.1, "pos": 0.9}) for t in texts]

    async def embed(self, model, texts, timeout_s):
        self._record(texts)
        return [Embedding(vector(t), len(t.split())) for t in texts]


def error_of(response, status):
    """The OpenAI-shaped error body of `response`, after checking its status and that nothing leaked."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and "/work" not in response.text
    return body["error"]

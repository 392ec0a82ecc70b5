"""The real all-MiniLM-L6-v2, exported, served by the real tritonserver behind the gateway, called with the
official `openai` SDK: the vectors match sentence-transformers on the same texts."""

import numpy as np
import openai
import pytest

from .conftest import EMBEDDER, minilm_path

TEXTS = ["A man is eating food.", "The package arrived on Tuesday.", "Das Essen war großartig — très bien, 👍", "ok",
         " ".join(["a very long sentence that goes on"] * 60)]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu").encode(TEXTS)


@pytest.fixture
def sdk(stack):
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=30)


def _cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.parametrize("encoding_format", ["base64", "float"])  # the SDK asks for base64 unless told
def test_served_vectors_match_sentence_transformers(sdk, reference, encoding_format):
    kwargs = {} if encoding_format == "base64" else {"encoding_format": "float"}
    result = sdk.embeddings.create(model=EMBEDDER, input=TEXTS, **kwargs)
    vectors = [d.embedding for d in sorted(result.data, key=lambda d: d.index)]
    assert len(vectors) == len(TEXTS) and all(len(v) == 384 for v in vectors)
    assert _cosines(vectors, reference).min() >= 0.9999
    assert result.usage.prompt_tokens > len(TEXTS) and result.model == EMBEDDER


def test_concurrent_requests_are_batched_and_stay_in_order(sdk, reference):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: sdk.embeddings.create(model=EMBEDDER, input=TEXTS[i % len(TEXTS)]), range(24)))
    for i, result in enumerate(results):
        assert _cosines([result.data[0].embedding], [reference[i % len(TEXTS)]])[0] >= 0.9999


def test_embeddings_of_a_classifier_are_refused(sdk):
    with pytest.raises(openai.BadRequestError):
        sdk.embeddings.create(model="tiny_sentiment", input="hello")

"""Through the real tritonserver and the gateway: the fixture ViT classifies base64 PNG / JPEG images
exactly as transformers' image-classification pipeline does (pre-processing included), a LoRA
adapter exported merged classifies text exactly as the unmerged PeftModel does, and an alias splits
traffic between the base and its fine-tune (a canary)."""

import base64
import io
import json

import httpx
import numpy as np
import pytest

from export.vision import sample_images
from fixture_models.vision import IMAGE_PROBES, solid_image
from serve.stack import start_gateway

from .conftest import LORA_CLASSIFIER, MODEL, VISION

TEXTS = ["I love this product, it works perfectly.", "Terrible. It broke after one day!", "The package arrived.", "ok"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _classify(stack, model, inputs):
    r = httpx.post(f"{stack.gateway_url}/v1/classify", json={"model": model, "input": inputs}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_served_image_classes_match_the_transformers_pipeline(stack, vit_checkpoint):
    from PIL import Image
    from transformers import pipeline

    images = sample_images()  # PNG and JPEG, RGBA, grayscale, CMYK, an EXIF rotation, odd sizes
    served = _classify(stack, VISION, [{"image": _b64(i)} for i in images])
    reference = pipeline("image-classification", model=str(vit_checkpoint), top_k=None)(
        [Image.open(io.BytesIO(i)) for i in images])
    assert len(served) == len(images)
    for got, theirs in zip(served, reference):
        assert got["label"] == theirs[0]["label"]
        assert max(abs(got["scores"][e["label"]] - e["score"]) for e in theirs) < 1e-5


def test_colours_are_recognised(stack):
    """The probes the fixture's build checked with a margin, sent as data URLs."""
    images = [{"image": f"data:image/{fmt.lower()};base64,{_b64(solid_image(rgb, fmt))}"} for rgb, fmt, _ in IMAGE_PROBES]
    assert [d["label"] for d in _classify(stack, VISION, images)] == [label for _, _, label in IMAGE_PROBES]


def test_a_corrupt_image_is_a_400_that_says_why(stack):
    png = sample_images()[0]
    r = httpx.post(f"{stack.gateway_url}/v1/classify", json={"model": VISION, "input": [{"image": _b64(png[:60])}]},
                   timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "PNG" in message and "Traceback" not in message
    assert len(_classify(stack, VISION, [{"image": _b64(png)}])) == 1  # and the model still serves


def _call_requests(stack, model: str) -> tuple[float, float]:
    """The gateway's histogram of requests per Triton call for `model`: (calls, requests)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{stack.gateway_url}/metrics", timeout=10).text
    found = {s.name: s.value for f in text_string_to_metric_families(text) if f.name == "rtxserve_triton_call_requests"
             for s in f.samples if s.labels.get("model") == model and s.name.endswith(("_count", "_sum"))}
    return found.get("rtxserve_triton_call_requests_count", 0.0), found.get("rtxserve_triton_call_requests_sum", 0.0)


def test_concurrent_requests_share_triton_calls_and_a_corrupt_image_fails_only_its_own(stack):
    """16 requests at once: those that arrive while a call is out leave together (the gateway's coalescing), and
    when Triton refuses the corrupt image of a coalesced call, only its request hears of it."""
    import asyncio

    png = sample_images()[0]
    bodies = [{"model": VISION, "input": [{"image": _b64(png[:60] if i == 5 else png)}]} for i in range(16)]
    calls_before, requests_before = _call_requests(stack, VISION)

    async def at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{stack.gateway_url}/v1/classify", json=b) for b in bodies))

    responses = asyncio.run(at_once())
    assert [r.status_code for r in responses] == [400 if i == 5 else 200 for i in range(16)], responses[5].text
    assert "PNG" in responses[5].json()["error"]["message"]
    (alone,) = _classify(stack, VISION, [{"image": _b64(png)}])
    for got in (r.json()["data"][0] for i, r in enumerate(responses) if i != 5):
        assert got["label"] == alone["label"]
        assert max(abs(got["scores"][k] - v) for k, v in alone["scores"].items()) < 1e-5
    calls, requests = _call_requests(stack, VISION)
    assert requests - requests_before >= 16  # the refused call's requests were sent again, one by one
    assert calls - calls_before < requests - requests_before  # some call carried more than one request


@pytest.fixture(scope="module")
def peft_reference(classifier_adapter):
    """Softmax of the unmerged PeftModel (base + adapter) on TEXTS, and of the base alone."""
    import torch

    from export.encoders.adapters import load_models, resolve_adapter
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    adapter = resolve_adapter(classifier_adapter, "text-classification")
    _, reference = load_models(adapter, AutoModelForSequenceClassification)
    tokenizer = AutoTokenizer.from_pretrained(adapter.checkpoint.path)
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        with_adapter = reference(**enc).logits.softmax(-1).numpy()
        with reference.disable_adapter():
            base = reference(**enc).logits.softmax(-1).numpy()
    return with_adapter, base


def test_a_merged_lora_adapter_serves_what_the_peft_model_computes(stack, peft_reference):
    with_adapter, base = peft_reference
    served = _classify(stack, LORA_CLASSIFIER, TEXTS)
    probs = np.array([list(d["scores"].values()) for d in served])
    assert np.abs(probs - with_adapter).max() < 1e-4
    # The adapter is really in the served model (log-probabilities: a confident classifier's probabilities barely move).
    assert np.abs(np.log(probs) - np.log(base)).max() > 0.1


def test_an_alias_splits_traffic_between_a_model_and_its_fine_tune(stack, tmp_path):
    """A canary through a gateway of its own on the session's Triton: `sentiment` sends half its requests to the
    base and half to the merged LoRA; each answer names its model and is that model's own answer."""
    direct = {m: _classify(stack, m, TEXTS[:1])[0]["scores"] for m in (MODEL, LORA_CLASSIFIER)}
    aliases = json.dumps({"sentiment": {MODEL: 50, LORA_CLASSIFIER: 50}})
    gateway, url = start_gateway(stack.triton_grpc_url, tmp_path, extra_env={"RTXSERVE_ALIASES": aliases})
    try:
        answers = [httpx.post(f"{url}/v1/classify", json={"model": "sentiment", "input": TEXTS[:1]}, timeout=60).json()
                   for _ in range(40)]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        run = _load_test(url, tmp_path / "run")  # the canary's load test: its report and comparison per target
    finally:
        gateway.stop()
    split = run.summary.by_model
    assert set(split) == {MODEL, LORA_CLASSIFIER} and sum(f["requests"] for f in split.values()) == run.summary.requests
    assert run.summary.errors == 0 and all(f["latency_ms"]["p50"] > 0 for f in split.values())
    assert "## Per answering model" in run.report.read_text()
    from loadtest.cli import main as loadtest

    assert loadtest(["compare", str(tmp_path / "run"), "--out", str(tmp_path / "compare")]) == 0
    page = (tmp_path / "compare" / "compare.md").read_text()
    assert f"# rtxserve compare: {MODEL} → {LORA_CLASSIFIER}" in page and "| requests |" in page
    assert (tmp_path / "compare" / "compare.png").stat().st_size > 10_000
    named = [a["model"] for a in answers]
    assert set(named) == {MODEL, LORA_CLASSIFIER}  # each with probability 1/2 per request: 2^-39 to see one only
    for answer in answers:
        assert answer["data"][0]["scores"] == pytest.approx(direct[answer["model"]], abs=1e-6)
    assert f'rtxserve_alias_requests_total{{alias="sentiment",model="{MODEL}"}} {named.count(MODEL)}.0' in metrics


def _load_test(url: str, out):
    from loadtest.runner import LoadSpec, run, scenario_options

    return run(LoadSpec(url, scenario_options(scenario="classify", model="sentiment"), users=2, duration_s=4,
                        warmup_s=0.5), out, log=lambda m: None)

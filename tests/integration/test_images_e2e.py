"""Image generation end to end on CPU: the tiny Stable Diffusion fixture and a LoRA for it, exported
(`rtxserve export diffusion`), served by the real tritonserver behind the gateway, called with the
`openai` SDK's images.generate: determinism by seed, the LoRA's effect (and its per-request scale),
served-vs-in-process parity, truncated prompts flagged, and the bounds checked before Triton."""

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from export.diffusion.stable_diffusion import reference_image
from fixture_models.diffusion import write_diffusion_lora, write_diffusion_pipeline
from serve.stack import start_stack

STEPS = 4


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    work = tmp_path_factory.mktemp("sd")
    pipe = write_diffusion_pipeline(work / "pipe")
    lora = write_diffusion_lora(pipe, work / "lora")
    for name, extra in (("tiny_sd", []), ("tiny_sd_lora", ["--lora", str(lora), "--lora-scale", "0.8"]),
                        ("tiny_sd_fused", ["--lora", str(lora), "--lora-scale", "0.8", "--fuse-lora"]),
                        # compiled, and warmed at load, at the size the tests ask: another size compiles again at
                        # its first request, past the SDK's timeout on a machine with a cold inductor cache
                        ("tiny_sd_compiled", ["--compile", "--size", "64"])):
        done = subprocess.run([sys.executable, "-m", "rtxserve.cli", "export", "diffusion", str(pipe), "--name", name,
                               "--repository", str(work / "repo"), "--steps", str(STEPS), *extra],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    # the compiled entry compiles its UNet as it loads: minutes with a cold inductor cache on a busy CI box
    with start_stack(work / "repo", work / "logs", timeout_s=900) as running:
        sdk = openai.OpenAI(base_url=f"{running.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield sdk, pipe, lora, running.gateway_url


def _pngs(response) -> list[bytes]:
    return [base64.b64decode(d.b64_json) for d in response.data]


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def test_the_sdk_gets_pngs_of_the_size_asked_and_the_same_seed_gives_the_same_images(sd):
    sdk, *_ = sd
    first = sdk.images.generate(model="tiny_sd", prompt="a red square on grass", size="64x64", n=2,
                                response_format="b64_json", extra_body={"seed": 7})
    images = _pngs(first)
    assert len(images) == 2 and all(Image.open(io.BytesIO(p)).size == (64, 64) for p in images)
    assert images[0] != images[1]  # n images of one request differ
    again = sdk.images.generate(model="tiny_sd", prompt="a red square on grass", size="64x64", n=2, extra_body={"seed": 7})
    other = sdk.images.generate(model="tiny_sd", prompt="a red square on grass", size="64x64", n=2, extra_body={"seed": 8})
    assert _pngs(again) == images and _pngs(other)[0] != images[0]
    assert first.model_extra["seed"] == 7


def test_the_served_image_is_the_pipeline_run_in_process(sd):
    sdk, pipe, lora, _ = sd
    for model, lora_path in (("tiny_sd", None), ("tiny_sd_lora", lora)):
        served = _pngs(sdk.images.generate(model=model, prompt="a blue circle", size="64x64", extra_body={"seed": 3}))[0]
        local = reference_image(pipe, lora_path, 0.8, "a blue circle", seed=3, steps=STEPS, size=64, guidance=7.5)
        diff = np.abs(_pixels(served) - _pixels(local))
        print(f"{model}: served vs in-process max pixel difference {diff.max()}, mean {diff.mean():.4f}")
        assert diff.max() <= 1  # the same torch and diffusers, one process or another: at most a rounding step


def test_a_compiled_unet_was_checked_at_export_and_serves_the_eager_image(sd):
    sdk, pipe, _, _ = sd
    meta = json.loads((pipe.parent / "repo" / "tiny_sd_compiled" / "rtxserve.json").read_text())
    figures = meta["unet_compile"]
    assert figures["min_cosine"] >= 0.999 and figures["cases"] == 4 and figures["compile_s"] > 0
    served = _pngs(sdk.images.generate(model="tiny_sd_compiled", prompt="a blue circle", size="64x64",
                                       extra_body={"seed": 3}))[0]
    local = reference_image(pipe, None, 0.8, "a blue circle", seed=3, steps=STEPS, size=64, guidance=7.5)
    diff = np.abs(_pixels(served) - _pixels(local))
    print(f"compiled: served vs eager in-process max pixel difference {diff.max()}, mean {diff.mean():.4f}")
    assert diff.max() <= 2


def test_the_lora_changes_the_image_and_a_request_can_set_its_scale(sd):
    sdk, *_ = sd
    kwargs = {"prompt": "a cat", "size": "64x64"}
    base = _pixels(_pngs(sdk.images.generate(model="tiny_sd", **kwargs, extra_body={"seed": 5}))[0])
    tuned = _pixels(_pngs(sdk.images.generate(model="tiny_sd_lora", **kwargs, extra_body={"seed": 5}))[0])
    off = _pixels(_pngs(sdk.images.generate(model="tiny_sd_lora", **kwargs, extra_body={"seed": 5, "lora_scale": 0.0}))[0])
    assert np.abs(tuned - base).mean() > 1.0  # the LoRA at the export's scale changes the image
    assert np.abs(off - base).max() <= 1  # at scale 0 it is the base pipeline's image again


def test_a_prompt_longer_than_the_text_encoder_takes_is_truncated_and_flagged(sd):
    sdk, *_ = sd
    response = sdk.images.generate(model="tiny_sd", prompt="a very long prompt " * 40, size="64x64", extra_body={"seed": 1})
    assert len(response.data) == 1 and response.model_extra["prompt_truncated_tokens"] > 0


@pytest.mark.parametrize("body, message", [
    ({"size": "60x64"}, "size 60x64: the width must be a positive multiple of 8"),
    ({"size": "2048x2048"}, "size 2048x2048: the width is over the limit of 1024 pixels"),
    ({"n": 9}, "n is 9; the limit is 4 images per request"),
    ({"num_inference_steps": 1000}, "num_inference_steps is 1000; the limit is 100"),
    ({"response_format": "url"}, "response_format url is not served"),
    ({"lora_scale": 0.5}, "this model has no LoRA"),
])
def test_out_of_bounds_requests_are_400s_that_name_the_limit(sd, body, message):
    import httpx

    *_, url = sd
    r = httpx.post(f"{url}/v1/images/generations", json={"model": "tiny_sd", "prompt": "x", **body}, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_the_images_scenario_reports_images_per_second_and_per_image_latency(sd, tmp_path):
    from loadtest.runner import LoadSpec, run, scenario_options

    *_, url = sd
    options = scenario_options(scenario="images", model="tiny_sd", batch=2, image_size="64x64", image_steps=2)
    # no warm-up: each request counts (beside the other test worker one image took over 6 s, and a 2 s warm-up left none)
    result = run(LoadSpec(url, options, users=2, duration_s=8, warmup_s=0), tmp_path / "load", log=print)
    images = result.summary.images
    assert result.summary.errors == 0 and images["images"] == 2 * images["requests"] > 0
    assert images["images_per_s"] == pytest.approx(2 * result.summary.qps, rel=0.01)
    assert images["per_image_ms"]["p50"] == pytest.approx(result.summary.latency_ms["p50"] / 2, rel=0.01)
    page = result.report.read_text()
    assert "## Images" in page and "images/s" in page


def test_the_export_lora_scale_comes_back_after_a_request_that_chose_another(sd):
    sdk, *_ = sd
    kwargs = {"model": "tiny_sd_lora", "prompt": "a dog", "size": "64x64"}
    first = _pngs(sdk.images.generate(**kwargs, extra_body={"seed": 9}))[0]
    sdk.images.generate(**kwargs, extra_body={"seed": 9, "lora_scale": 0.0})
    assert _pngs(sdk.images.generate(**kwargs, extra_body={"seed": 9}))[0] == first
    explicit = _pngs(sdk.images.generate(**kwargs, extra_body={"seed": 9, "lora_scale": 0.8}))[0]
    assert explicit == first  # the export's 0.8, named or not


def test_a_fused_lora_makes_the_unfused_image_and_keeps_its_scale(sd):
    sdk, *_ = sd
    kwargs = {"prompt": "a house", "size": "64x64", "extra_body": {"seed": 4}}
    fused = _pixels(_pngs(sdk.images.generate(model="tiny_sd_fused", **kwargs))[0])
    unfused = _pixels(_pngs(sdk.images.generate(model="tiny_sd_lora", **kwargs))[0])
    diff = np.abs(fused - unfused)
    print(f"fused vs unfused LoRA at 0.8: max pixel difference {diff.max()}, mean {diff.mean():.4f}")
    assert diff.max() <= 2  # the same weights, summed once instead of every step: rounding only
    with pytest.raises(openai.BadRequestError, match="fused into its weights at scale 0.8"):
        sdk.images.generate(model="tiny_sd_fused", prompt="x", extra_body={"lora_scale": 0.3})


def test_each_entry_draws_its_reference_set_as_its_pipeline_did(sd):
    """`rtxserve eval` on every entry: the export's reference images (the pipeline run in-process on two probes, same
    seed) drawn again through the gateway; the fused LoRA and the compiled UNet are held to a lossy variant's bound."""
    from core.reference import ReferenceSet
    from loadtest.eval.run import evaluate

    *_, url = sd
    repo = Path(sd[1]).parent / "repo"
    for model in ("tiny_sd", "tiny_sd_lora", "tiny_sd_fused", "tiny_sd_compiled"):
        ref = ReferenceSet.read(repo / model)
        result = evaluate(url, model, ref)
        assert result.passed, (model, result.verdict(), [a.served for a in result.answers])
        assert ref.variant == {"tiny_sd": "fp32", "tiny_sd_lora": "fp32", "tiny_sd_fused": "fused-lora",
                               "tiny_sd_compiled": "compiled"}[model]

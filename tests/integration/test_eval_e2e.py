"""`rtxserve eval` against real servers: every encoder the session's tritonserver serves answers as its framework did
on the reference set its export wrote (through the gateway, as a client); an int8 variant passes within what export
measured and fails under a tighter threshold; the tiny Llama and its adapter, packaged by `rtxserve export llm`, answer
as transformers (and PEFT) do; and the chat Llama packaged with another chat template than it was trained with fails."""

import json
import subprocess
import sys

import pytest

from core.reference import ReferenceSet
from export.encoders.encoder import EncoderOptions, export_text_classification
from export.llm.llm import LLMOptions, export_llm
from export.triton.entry import EntryOptions
from fixture_models.llm import CHAT_ANSWERS, write_chat_llm
from loadtest.eval.run import evaluate
from serve.stack import start_stack, start_gateway, start_vllm
from serve.vllm_server import VLLMOptions
from tests.conftest import built_once
from tests.integration import VLLM_EAGER

from .conftest import DETECTOR, EMBEDDER, LORA_CLASSIFIER, MODEL, RT_DETR, TAGGER, VISION, YOLO, YOLOS


@pytest.mark.parametrize("model", [MODEL, EMBEDDER, TAGGER, VISION, DETECTOR, RT_DETR, YOLOS, YOLO, LORA_CLASSIFIER])
def test_every_encoder_answers_as_its_framework_did_on_its_reference_set(stack, model):
    ref = ReferenceSet.read(stack.repository / model)
    result = evaluate(stack.gateway_url, model, ref)
    assert result.passed, (result.verdict(), [(i, a.detail) for i, a in zip(result.inputs, result.answers)])
    assert len(result.answers) == len(ref.items) and all(a.agrees for a in result.answers)


def test_the_eval_command_writes_its_report_and_says_so_in_its_exit_status(stack, tmp_path):
    done = subprocess.run([sys.executable, "-m", "rtxserve.cli", "eval", stack.gateway_url, TAGGER, "--reference",
                           str(stack.repository / TAGGER), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and f"{TAGGER}: PASSED" in done.stdout, done.stdout + done.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"eval.md", "eval.html", "eval.png", "eval.json"}
    assert json.loads((tmp_path / "eval.json").read_text())["passed"] is True
    # a threshold no served model can meet fails it, and the exit status says so
    strict = subprocess.run([sys.executable, "-m", "rtxserve.cli", "eval", stack.gateway_url, TAGGER, "--reference",
                             str(stack.repository / TAGGER), "--out", str(tmp_path), "--max-score-diff", "0",
                             "--min-agreement", "1"], capture_output=True, text=True, timeout=120)
    drift = max(i["drift"] for i in json.loads((tmp_path / "eval.json").read_text())["inputs"])
    assert (strict.returncode, "DRIFTED" in strict.stdout) == ((1, True) if drift > 0 else (0, False)), strict.stdout
    wrong = subprocess.run([sys.executable, "-m", "rtxserve.cli", "eval", stack.gateway_url, TAGGER, "--reference",
                            str(stack.repository / TAGGER), "--max-logit-diff", "1"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "--max-logit-diff does not apply to token-classification" in wrong.stderr
    missing = subprocess.run([sys.executable, "-m", "rtxserve.cli", "eval", stack.gateway_url, TAGGER, "--reference",
                              str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nowhere" in missing.stderr and "no reference set" in missing.stderr


def test_an_int8_variant_passes_within_what_export_measured_and_fails_under_a_tighter_threshold(classifier_checkpoint,
                                                                                                 tmp_path):
    export_text_classification(classifier_checkpoint, EntryOptions(name="int8"), tmp_path / "repo",
                               EncoderOptions(precision="int8"))
    ref = ReferenceSet.read(tmp_path / "repo" / "int8")
    assert ref.variant == "int8" and ref.drift["max_abs_diff"] > 0
    with start_stack(tmp_path / "repo", tmp_path / "logs") as running:
        served = evaluate(running.gateway_url, "int8", ref)
        assert served.passed, served.verdict()  # within 2x what export measured on the same inputs
        worst = max(a.drift for a in served.answers)
        assert worst > 0  # a lossy variant drifts from the framework, as export said it would
        tighter = evaluate(running.gateway_url, "int8", ref, limits={"drift": worst / 2})
    assert not tighter.passed and "max |Δlogit|" in tighter.verdict()


def test_the_tiny_llama_and_its_adapter_answer_as_transformers_and_peft_do(llm_servers, llm_fixtures, tmp_path):
    gateway = llm_servers[0]
    for source, name in ((llm_fixtures / "base", "tiny-llama"), (llm_fixtures / "adapter-a", "adapter-a")):
        export_llm(source, tmp_path / name, LLMOptions())
        ref = ReferenceSet.read(tmp_path / name)
        assert {"messages" in i.input for i in ref.items} == {True, False}  # chats, and plain prompts
        result = evaluate(gateway, name, ref)
        assert result.passed, (name, result.verdict(), [a.detail for a in result.answers])


def test_a_chat_llm_packaged_with_another_chat_template_than_it_was_trained_with_fails(tmp_path_factory, tmp_path):
    """The trained chat Llama's own template against one that names the roles otherwise: the package ships the
    wrong one (export took --chat-template), the reference set holds what the model answers through its own."""
    base = built_once(tmp_path_factory, "chat-llm", write_chat_llm)
    wrong = tmp_path / "wrong.jinja"
    wrong.write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}### assistant:{% endif %}")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}) + "\n"
                                 for q, a in CHAT_ANSWERS.items()))
    package = export_llm(base, tmp_path / "pkg", LLMOptions(chat_template=wrong, eval_set=questions)).out
    vllm, url = start_vllm(VLLMOptions(model=package, served_name="chat", max_model_len=512, extra_args=VLLM_EAGER),
                           tmp_path)
    try:
        gateway, gateway_url = start_gateway("", tmp_path, vllm_url=url, extra_env={"RTXSERVE_TRITON_GRPC_URL": ""})
        try:
            result = evaluate(gateway_url, "chat", ReferenceSet.read(package))
        finally:
            gateway.stop()
    finally:
        vllm.stop()
    assert not result.passed and result.gold["framework"] == 1.0 and result.gold["served"] < 1.0, result.verdict()
    assert any("first divergent token" in a.detail for a in result.answers)

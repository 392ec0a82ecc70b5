"""The deployment file, the GPU memory planner and the services a deployment runs (the pure step), on the
planning stand-ins of real-sized models (tests/plan_fixtures.py: real headers and configs, no weights)."""

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from deploy.plan import GIB, format_plan, plan
from deploy.services import Layout, build_services, gateway_settings
from deploy.spec import DeploymentError
from deploy.load import check_artifacts, load_deployment, parse_deployment
from tests.plan_fixtures import TINY_WHISPER, WHISPER_LARGE_V3, write_boxes, write_entry, write_llama, write_whisper

BASE = {"name": "box", "gpus": {"count": 1},
        "models": [{"name": "enc", "kind": "encoder", "path": "repo/enc"}, {"name": "llm", "kind": "llm", "path": "llm"}]}


@pytest.fixture(scope="module")
def boxes(tmp_path_factory):
    return write_boxes(tmp_path_factory.mktemp("boxes"))


@pytest.mark.parametrize("change, message", [
    ({"name": "My_Box"}, "name: 'My_Box' is not a DNS label"),
    ({"gpus": {"count": -1}}, "gpus.count: Input should be greater than or equal to 0"),
    ({"ports": {"gateway": 8001}}, "ports: 8001 is used twice (ports.gateway and ports.triton_grpc)"),
    ({"ports": {"vllm": 8080}}, "ports: 8080 is used twice (ports.gateway and vLLM engine llm#0"),
    ({"models": [{"name": "llm", "kind": "llm", "path": "llm", "replicas": 2}]}, "models[0].replicas: 2 engines need 2 GPUs"),
    ({"models": [{"name": "enc", "kind": "encoder", "path": "e", "instances": 0}]}, 'models[0].instances: use 1..64 or "auto"'),
    ({"models": [{"name": "enc", "kind": "bert", "path": "e"}]}, "models[0]: Input tag 'bert' found using 'kind'"),
    ({"models": [{"name": "a", "kind": "encoder", "path": "e"}, {"name": "a", "kind": "llm", "path": "l"}]},
     "models[1]: the name 'a' is already used by models[0]"),
    ({"models": [{"name": "l", "kind": "llm", "path": "l", "adapters": {"l": "a"}}]}, "the name 'l' is already used"),
    ({"models": [{"name": "enc", "kind": "encoder", "path": "e", "slo": "p99"}]}, "models[0].slo: SLO: expected NAME:MS"),
    ({"gateway": {"host": "0.0.0.0"}}, "gateway.keys_file: required when gateway.host is 0.0.0.0"),
    ({"gateway": {"settings": {"vllm_url": "x"}}}, "gateway.settings: vllm_url come from the deployment itself"),
    ({"gateway": {"settings": {"max_tokenz": 5}}}, "gateway.settings: max_tokenz: Extra inputs are not permitted"),
    ({"gateway": {"settings": {"max_tokens": 0}}}, "gateway.settings: max_tokens: Input should be greater than or equal to 1"),
    ({"modles": []}, "modles: Extra inputs are not permitted"),
    ({"models": [{"name": "asr", "kind": "speech", "path": "w", "adapters": {"a": "a"}, "max_images": 1}]},
     "models[0]: adapters, max_images: chat options; a speech model takes none"),
    ({"models": [{"name": "llm", "kind": "llm", "path": "l", "replicas": 2}]},
     "models[0].replicas: 2 engines need 2 GPUs (one engine per GPU); the box has 1"),
    ({"models": [{"name": "enc", "kind": "encoder", "path": "e", "idle_unload_s": 60}]},
     "models[0]: idle_unload_s: applies to resident: on-demand models"),
])
def test_each_error_names_its_field(change, message):
    with pytest.raises(DeploymentError) as err:
        parse_deployment(BASE | change)
    assert message in str(err.value)


def test_a_file_that_is_not_a_mapping_or_not_yaml_says_so(tmp_path):
    (tmp_path / "a.yaml").write_text("- just\n- a list\n")
    (tmp_path / "b.yaml").write_text("name: [unclosed\n")
    with pytest.raises(DeploymentError, match="a YAML mapping"):
        load_deployment(tmp_path / "a.yaml")
    with pytest.raises(DeploymentError, match="not valid YAML"):
        load_deployment(tmp_path / "b.yaml")
    with pytest.raises(DeploymentError, match="cannot read"):
        load_deployment(tmp_path / "none.yaml")


def test_an_artifact_missing_or_of_the_wrong_kind_is_named(tmp_path):
    write_llama(tmp_path / "llm", {**json.loads('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                                                '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}')})
    write_entry(tmp_path / "repo", "enc")
    swapped = BASE | {"models": [{"name": "llm", "kind": "encoder", "path": "llm"}]}
    with pytest.raises(DeploymentError, match=r"models.llm: .*/llm is not a Triton entry .* \(an LLM folder: use kind: llm\)"):
        check_artifacts(parse_deployment(swapped, tmp_path))
    swapped = BASE | {"models": [{"name": "enc", "kind": "llm", "path": "repo/enc"}]}
    with pytest.raises(DeploymentError, match=r"models.enc: .* \(no config.json\) \(a Triton entry: use kind: encoder\)"):
        check_artifacts(parse_deployment(swapped, tmp_path))
    on_cpu = BASE | {"gpus": {"count": 0}, "models": [BASE["models"][0]]}
    with pytest.raises(DeploymentError, match="exported for gpu but this deployment runs on cpu; export it again with --target cpu"):
        check_artifacts(parse_deployment(on_cpu, tmp_path))
    write_whisper(tmp_path / "whisper", TINY_WHISPER)
    for kind, path, message in (("llm", "whisper", "is a speech model (Whisper); use kind: speech"),
                                ("speech", "llm", "is not a speech model (Whisper); use kind: llm")):
        swapped = BASE | {"models": [{"name": "m", "kind": kind, "path": path}]}
        with pytest.raises(DeploymentError, match=re.escape(f"models.m: {tmp_path / path} {message}")):
            check_artifacts(parse_deployment(swapped, tmp_path))
    missing = BASE | {"models": [{**BASE["models"][1], "adapters": {"a": "nowhere"}}]}
    with pytest.raises(DeploymentError, match="models.llm.adapters.a: .*/nowhere is not a PEFT adapter folder"):
        check_artifacts(parse_deployment(missing, tmp_path))


@pytest.mark.parametrize("meta", [{"embedding_size": 384},
                                  {"dimensions": 384, "model_dimensions": None}])  # as export wrote it before the schema
def test_an_embeddings_entry_plans_as_every_encoder_does(tmp_path, meta, caplog):
    write_entry(tmp_path / "repo", "minilm", task="feature-extraction", meta={k: v for k, v in meta.items() if v})
    if "model_dimensions" in meta:  # the old file had only the one "dimensions" key
        path = tmp_path / "repo" / "minilm" / "rtxserve.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "model_dimensions"}))
    d = parse_deployment({"name": "box", "gpus": {"count": 1},
                          "models": [{"name": "minilm", "kind": "encoder", "path": "repo/minilm"}]}, tmp_path)
    estimate = plan(d).estimates["minilm"]
    old = "dimensions" in meta
    # the new file: activations sized from BERT-base's dimensions; the old one had none to size them from
    assert ("activations assumed equal to weights" in " ".join(estimate.notes)) == old
    assert ("'dimensions' (written before the schema) read as the embedding size" in caplog.text) == old


def test_an_entry_metadata_it_cannot_read_is_one_line_naming_the_entry_and_field(tmp_path, capsys):
    from deploy.cli import plan_main

    write_entry(tmp_path / "repo", "enc", meta={"max_length": "long"})
    (tmp_path / "box.yaml").write_text(yaml.safe_dump(BASE | {"models": [BASE["models"][0]]}))
    assert plan_main([str(tmp_path / "box.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rtxserve plan: error: models.enc: {tmp_path / 'repo' / 'enc' / 'rtxserve.json'}: max_length: "
                   "Input should be a valid integer, unable to parse string as an integer")


def test_one_4090_holds_an_8b_llm_with_two_adapters_and_four_bert_base(boxes):
    p = plan(load_deployment(boxes[0]))
    llm = p.estimates["llama-3-8b"]
    # Llama-3-8B: 8.03 B parameters at 2 bytes; KV 2 x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB a token
    assert llm.parts["weights"] == pytest.approx(8_030_261_248 * 2 / GIB)
    assert llm.parts["kv_cache"] == pytest.approx(128 * 1024 * 8 * 4096 / GIB)
    assert llm.parts["lora"] == pytest.approx(2 * 16 * 32 * (2 * 8192 + 2 * 5120 + 3 * 18432) * 2 / GIB)
    assert p.fits and p.instances["bert_classifier"] == 4 and p.engines == {"llama-3-8b": [0]}
    # 20.45 GiB, less the 0.6 GiB CUDA context vLLM keeps beside its share, of the card's total as the CUDA runtime
    # reports it, 23.64 GiB (vLLM takes its share of that total, not of the 23.6 CUDA hands out)
    assert p.gpu_memory_utilization["llama-3-8b"] == pytest.approx(0.84)
    assert p.more == {"bert_classifier": 0, "llama-3-8b": 0} and 0 < p.devices[0].free_gib < p.estimates["bert_classifier"].gib
    table = format_plan(p)
    assert "GPU 0: " in table and "bert_classifier              instances      4" in table
    assert "would also fit" not in table  # nothing more fits: no "+0" line


def test_auto_instances_fill_each_gpu_beside_its_engine(boxes):
    p = plan(load_deployment(boxes[1]))
    assert p.fits and sorted(p.engines["llama-3-8b"]) == [0, 1, 2, 3]
    bert = p.estimates["bert_classifier"].gib
    # filled until one more does not fit, on every GPU
    assert p.instances["bert_classifier"] == 4 and all(0 <= d.free_gib < bert for d in p.devices)
    assert p.more["bert_classifier"] == 0


def test_what_does_not_fit_is_refused_with_per_gpu_numbers(boxes, capsys):
    from deploy.cli import plan_main

    data = yaml.safe_load(boxes[0].read_text())
    data["models"][1]["max_num_seqs"] = 32  # 16 GiB of KV cache beside 15 GiB of weights
    big = boxes[0].with_name("too-big.yaml")
    big.write_text(yaml.safe_dump(data))
    assert plan_main([str(big)]) == 2
    out = capsys.readouterr().out
    assert "GPU 0: " in out and "OVER by" in out and "DOES NOT FIT: over on GPU 0 by" in out


def test_the_services_are_the_servers_options_wherever_they_run(boxes):
    d = load_deployment(boxes[0])
    p = plan(d)
    inside = Layout(bind="0.0.0.0", host_of=lambda s: s, path=lambda path: "/models/" + path.name,
                    repository="/models/repository", gateway_config="/etc/rtxserve/gateway.yaml", gateway_host="0.0.0.0")
    triton, engine, gateway = build_services(d, p, inside)
    assert "--model-repository=/models/repository" in triton.args and "--http-address=0.0.0.0" in triton.args
    args = " ".join(engine.args)
    assert "--model /models/llama-3-8b" in args and "--gpu-memory-utilization 0.84" in args and "--max-num-seqs 8" in args
    assert "--lora-modules support=/models/adapter-support sales=/models/adapter-sales" in args and "--max-lora-rank 16" in args
    assert engine.gpu == 0 and engine.name == "vllm-llama-3-8b-0"
    settings = gateway_settings(d, inside, p)
    assert settings["vllm_url"] == "http://vllm-llama-3-8b-0:8100" and settings["triton_grpc_url"] == "triton:8001"
    assert settings["required_models"] == ["bert_classifier", "llama-3-8b", "support", "sales"]
    assert gateway.env == {"RTXSERVE_CONFIG": "/etc/rtxserve/gateway.yaml"}


def test_the_bundled_deployment_points_into_the_bundle():
    from deploy.bundle import bundle_deployment

    d = parse_deployment({"name": "box", "gpus": {"count": 2}, "gateway": {"keys_file": "k.json"}, "models": [
        {"name": "enc", "kind": "encoder", "path": "/x/enc"}, {"name": "sd", "kind": "diffusion", "path": "/x/sd"},
        {"name": "llm", "kind": "llm", "path": "/x/llm", "adapters": {"a": "/x/a"}},
        {"name": "asr", "kind": "speech", "path": "/x/whisper"}]})
    models = {m["name"]: m for m in bundle_deployment(d)["models"]}
    assert models["asr"]["path"] == "models/llm/asr"
    assert models["enc"]["path"] == "models/repository/enc" and models["sd"]["path"] == "models/repository/sd"
    assert models["llm"]["path"] == "models/llm/llm" and models["llm"]["adapters"] == {"a": "models/adapters/a"}
    assert "adapters" not in models["sd"]
    parse_deployment(bundle_deployment(d))  # and it is a valid deployment


def test_a_vision_language_model_gets_its_image_limits_and_the_gateways_image_hosts(boxes):
    data = yaml.safe_load(boxes[0].read_text())
    llm = next(m for m in data["models"] if m["kind"] == "llm")
    llm |= {"max_images": 2, "max_image_pixels": 401408}
    data["gateway"] = {**data.get("gateway", {}), "settings": {"chat_image_domains": ["images.example.com"]}}
    vl = boxes[0].with_name("vl.yaml")
    vl.write_text(yaml.safe_dump(data))
    d = load_deployment(vl)
    local = Layout(bind="127.0.0.1", host_of=lambda s: "127.0.0.1", path=lambda path: str(path), repository="r",
                   gateway_config="g", gateway_host="127.0.0.1")
    args = " ".join(build_services(d, plan(d), local)[1].args)
    assert '--limit-mm-per-prompt {"image": 2}' in args and '--mm-processor-kwargs {"max_pixels": 401408}' in args
    assert "--allowed-media-domains images.example.com" in args


def test_a_whisper_plans_its_decoder_and_cross_attention_cache_and_runs_vllms_image_with_audio(tmp_path):
    """Whisper large-v3 (its real header: 1.54 B parameters, 3.09 GB in float16 as published) on one 4090 beside a
    BERT classifier: vLLM caches, per sequence, the transcript's tokens and the 1500 encoder states in each of 32
    decoder layers."""
    from deploy.images import SPEECH_VLLM_IMAGE, VLLM_IMAGE
    from deploy.render import render
    from serve.gateway.access.keys import write_keys

    write_whisper(tmp_path / "whisper-large-v3", WHISPER_LARGE_V3)
    write_entry(tmp_path / "repo", "enc")
    write_keys(tmp_path / "keys.json", {})
    d = parse_deployment({"name": "asr-box", "gpus": {"count": 1}, "gateway": {"keys_file": "keys.json"},
                          "kubernetes": {"registry": "registry.example.com/ml"},
                          "models": [{"name": "enc", "kind": "encoder", "path": "repo/enc"},
                                     {"name": "whisper", "kind": "speech", "path": "whisper-large-v3", "max_num_seqs": 16}]},
                         tmp_path)
    p = plan(d)
    e = p.estimates["whisper"]
    assert e.kind == "speech" and e.parts["weights"] == pytest.approx(1_543_490_560 * 2 / GIB)
    per_token = 2 * 32 * 1280 * 2  # keys and values, 32 decoder layers, d_model 1280, float16: 160 KiB
    assert e.parts["kv_cache"] == pytest.approx(per_token * 16 * (448 + 1500) / GIB)  # 4.76 GiB
    assert "(448 tokens + 1500 encoder states)" in " ".join(e.notes) and p.fits and p.engines == {"whisper": [0]}
    render(d, tmp_path / "out", at=Path("/opt/asr"), prefix=Path("/opt/asr"))
    out = tmp_path / "out"
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())["services"]["vllm-whisper-0"]
    assert compose["image"] == SPEECH_VLLM_IMAGE and compose["build"] == {"context": "../vllm-audio-image"}
    assert f"FROM {VLLM_IMAGE}" in (out / "vllm-audio-image" / "Dockerfile").read_text()
    assert (out / "vllm-audio-image" / "requirements.txt").read_text().split() == ["soundfile>=0.12", "av>=12"]
    pod = next(doc for doc in yaml.safe_load_all((out / "kubernetes" / "gpu-0.yaml").read_text())
               if doc["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == f"registry.example.com/ml/{SPEECH_VLLM_IMAGE}"
    assert "/bin/vllm serve /opt/asr/models/llm/whisper " in (out / "systemd" / "rtxserve-asr-box-vllm-whisper-0.service").read_text()
    settings = yaml.safe_load((out / "gateway.yaml").read_text())
    assert settings["required_models"] == ["enc", "whisper"] and settings["vllm_url"] == "http://vllm-whisper-0:8100"


def test_a_speech_box_bundles_vllms_wheels_with_the_audio_packages_and_the_audio_image(tmp_path, monkeypatch):
    """`deploy bundle` of a GPU box serving a Whisper, with pip's wheel and download steps recorded instead of run
    (vLLM's CUDA wheels are gigabytes, and a speech box bundles only for GPUs: test_deploy_bundle installs an
    encoder box's archive for real): vLLM's wheels with soundfile and av, the audio image's wheels for its Python,
    the model under models/llm, and every file in SHA256SUMS."""
    import tarfile

    import deploy.bundle as bundle
    from deploy.images import VLLM_IMAGE, VLLM_IMAGE_PYTHON
    from serve.gateway.access.keys import write_keys

    asked, pinned = {}, {}

    def wheels(name, requirements, to, cache, log, pin=True):
        asked[name], pinned[name] = requirements, pin
        to.mkdir(parents=True, exist_ok=True)
        (to / f"{name}-0-py3-none-any.whl").write_bytes(b"wheel")
        (to / "requirements.txt").write_text("\n".join(requirements))

    def image_wheels(context, image, python, cache, log):
        asked[context.name] = (image, python, (context / "requirements.txt").read_text().split())
        (context / "wheels" / "soundfile-0-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(bundle, "_wheels", wheels)
    monkeypatch.setattr(bundle, "_image_wheels", image_wheels)
    monkeypatch.setattr(bundle, "is_cpu_build", lambda env: True)  # bundled on a CPU checkout
    write_whisper(tmp_path / "whisper", TINY_WHISPER)
    write_keys(tmp_path / "keys.json", {})
    d = parse_deployment({"name": "asr", "gpus": {"count": 1}, "gateway": {"keys_file": "keys.json"},
                          "models": [{"name": "whisper", "kind": "speech", "path": "whisper"}]}, tmp_path)
    out = bundle.bundle(d, tmp_path / "asr.tar", prefix=Path("/opt/asr"), log=lambda line: None)
    assert asked["vllm"] == ["vllm==0.32.0", "soundfile>=0.12", "av>=12"]  # deploy/vllm/requirements-cuda.txt
    # not pinned to the checkout's CPU freeze (torch ...+cpu would keep vLLM's CUDA wheels out); the gateway's are
    assert pinned == {"gateway": True, "vllm": False}
    assert "triton" not in asked and "triton-image" not in asked  # no Triton model on this box
    assert asked["vllm-audio-image"] == (VLLM_IMAGE, VLLM_IMAGE_PYTHON, ["soundfile>=0.12", "av>=12"])
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        deployment = yaml.safe_load(tar.extractfile("rtxserve-asr/deployment.yaml"))
        sums = tar.extractfile("rtxserve-asr/SHA256SUMS").read().decode()
    for path in ("wheels/vllm/vllm-0-py3-none-any.whl", "vllm-audio-image/wheels/soundfile-0-py3-none-any.whl",
                 "vllm-audio-image/Dockerfile", "models/llm/whisper/config.json", "install.sh"):
        assert f"rtxserve-asr/{path}" in names and f"  {path}\n" in sums, path
    (model,) = deployment["models"]
    assert (model["kind"], model["path"]) == ("speech", "models/llm/whisper")


def test_the_whisper_stand_in_has_transformers_own_tensor_names_and_shapes(tmp_path):
    """The planning stand-in is what save_pretrained writes (its output projection tied to the token embedding)."""
    from safetensors import safe_open
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = {k: v for k, v in TINY_WHISPER.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config |= dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"), 1)  # < vocab
    real = {k: list(v.shape) for k, v in WhisperForConditionalGeneration(WhisperConfig(**config)).state_dict().items()
            if k != "proj_out.weight"}
    with safe_open(write_whisper(tmp_path / "w", TINY_WHISPER) / "model.safetensors", "np") as f:
        assert {k: f.get_slice(k).get_shape() for k in f.keys()} == real


def _llama_2_13b(tmp_path, quantization, kv_cache_dtype="auto", max_model_len=4096):
    from tests.plan_fixtures import LLAMA_2_13B

    write_llama(tmp_path / str(quantization), LLAMA_2_13B, quantization)
    return plan(parse_deployment({"name": "box", "gpus": {"count": 1}, "models": [
        {"name": "llama-2-13b", "kind": "llm", "path": str(quantization), "max_num_seqs": 24,
         "max_model_len": max_model_len, "kv_cache_dtype": kv_cache_dtype}]}, tmp_path))


def test_a_13b_fits_one_4090_only_quantised_and_its_cache_holds_what_is_left(tmp_path):
    """Llama-2-13B (13,015,864,320 parameters; 40 KV heads: 2 x 40 layers x 40 x 128 x 2 bytes = 800 KiB a token) on
    one 4090 with 24 sequences of 4,096 tokens: in float16 its weights alone are over the card; at w4a16 they fit,
    but 24 x 4,096 tokens of cache do not, and the plan says how many tokens the rest of the card holds."""
    fp16 = _llama_2_13b(tmp_path, None)
    e = fp16.estimates["llama-2-13b"]
    assert not fp16.fits and e.parts["weights"] == pytest.approx(13_015_864_320 * 2 / GIB) and e.parts["weights"] > 23.6
    assert e.kv_bytes_per_token == 800 * 1024 and fp16.kv_room_tokens == {"llama-2-13b": 0}
    w4 = _llama_2_13b(tmp_path, "w4a16")
    e = w4.estimates["llama-2-13b"]
    # as stored: 12,687,769,600 linear weights at half a byte, a float16 scale per 128 of them, each layer's shape
    # (2 x int64), and the embeddings, lm_head and norms in float16 (656,189,440 bytes)
    assert e.parts["weights"] == pytest.approx((6_343_884_800 + 198_246_400 + 280 * 16 + 656_189_440) / GIB)
    assert "quantised (compressed-tensors int4): 7.20 GB as stored" in e.notes
    assert e.parts["kv_cache"] == pytest.approx(75.0) and not w4.fits
    room = w4.kv_room_tokens["llama-2-13b"]
    assert room == int((23.6 - (e.gib - e.parts["kv_cache"])) * GIB // (800 * 1024)) and room // 4096 == 4
    assert f"room for {room} tokens of KV cache (4 sequences of 4096); planned 98304" in format_plan(w4)
    fp8_kv = _llama_2_13b(tmp_path, "w4a16", "fp8")
    assert fp8_kv.estimates["llama-2-13b"].kv_bytes_per_token == 400 * 1024 and fp8_kv.kv_room_tokens["llama-2-13b"] // 4096 == 9
    short = _llama_2_13b(tmp_path, "w4a16", max_model_len=640)  # 24 x 640 tokens: 11.7 GiB of cache
    assert short.fits and short.more == {"llama-2-13b": 0}
    assert "would also fit" not in format_plan(short)  # nothing more fits: no "+0 engine(s)" line


def test_an_fp8_kv_cache_reaches_vllm_on_a_cpu_box_too(tmp_path):
    """vLLM's CPU attention keeps an fp8 cache as well: the option is passed wherever the engine runs, and the
    planner counts half the bytes per token."""
    from tests.plan_fixtures import TINY_LLAMA

    write_llama(tmp_path / "llm", TINY_LLAMA)
    estimates = {}
    for dtype in ("auto", "fp8"):
        d = parse_deployment({"name": "box", "models": [{"name": "llm", "kind": "llm", "path": "llm",
                                                          "kv_cache_dtype": dtype, "dtype": "float16"}]}, tmp_path)
        p = plan(d)
        estimates[dtype] = p.estimates["llm"].kv_bytes_per_token
        args = build_services(d, p, Layout(path=str, repository="r", gateway_config="g"))[0].args
        assert ("--kv-cache-dtype" in args) == (dtype == "fp8")
    assert estimates["fp8"] * 2 == estimates["auto"]


def test_the_triton_image_installs_every_package_the_local_triton_environment_serves_entries_with():
    """The rendered Triton image runs the same python-backend steps as `serve up` here (YOLO's letterbox and NMS
    import OpenCV): its requirements are the local environment's, less the tritonserver that NGC's image is."""
    from deploy.images import HERE, _requirements, triton_image_requirements

    local = {str(r) for r in _requirements(HERE / "triton" / "requirements.txt") if r.name != "nvidia-pytriton"}
    image = {line for line in triton_image_requirements(diffusion=False).splitlines()
             if line.strip() and not line.startswith("#")}
    assert image == local and "opencv-python-headless>=4.8" in image


def test_a_detector_is_planned_from_its_graphs_activations_at_the_deployments_max_batch(tmp_path):
    """A YOLO entry records no transformer dimensions, but export records its graph's live tensors (fixed, and per
    image at its largest input): the planner sizes the deployment's max batch from them, with the arena's rounding."""
    graph = {"per_item_bytes": 48_000_000, "fixed_bytes": 2_000_000, "item_shape": [3, 640, 640]}
    write_entry(tmp_path / "repo", "yolo", task="object-detection", dims={}, params=9_400_000, precision="fp32",
                meta={"graph_activations": graph})
    d = parse_deployment({"name": "det-box", "gpus": {"count": 1},
                          "models": [{"name": "yolo", "kind": "encoder", "path": "repo/yolo", "instances": 2,
                                      "max_batch_size": 4}]}, tmp_path)
    e = plan(d).estimates["yolo"]
    assert e.parts["activations"] == pytest.approx(2.0 * (2_000_000 + 4 * 48_000_000) / GIB)
    assert "activations from the graph's tensors at 3x640x640 per image" in e.notes


def test_an_entry_without_dimensions_or_graph_activations_is_assumed_and_says_so(tmp_path):
    """An entry exported before graph activations were recorded: activations as much again as the weights, and the
    note says to export it again."""
    write_entry(tmp_path / "repo", "yolo", task="object-detection", dims={}, params=9_400_000, precision="fp32")
    d = parse_deployment({"name": "det-box", "gpus": {"count": 1},
                          "models": [{"name": "yolo", "kind": "encoder", "path": "repo/yolo", "instances": 2}]},
                         tmp_path)
    e = plan(d).estimates["yolo"]
    assert e.parts["activations"] == pytest.approx(e.parts["weights"]) == pytest.approx(9_400_000 * 4 / GIB)
    assert "activations assumed equal to weights (export it again to record them)" in " ".join(e.notes)


def _on_demand_box(tmp_path, swap_room_gib=None, fine_tunes=6, idle=None) -> Path:
    """One GPU with an 8B engine beside it, one always-resident BERT and `fine_tunes` on-demand BERT fine-tunes."""
    write_llama(tmp_path / "llm")
    for i in range(fine_tunes + 1):
        write_entry(tmp_path / "repo", f"bert_{i}")
    models = [{"name": "llm", "kind": "llm", "path": "llm", "max_num_seqs": 4, "max_model_len": 4096},
              {"name": "bert_0", "kind": "encoder", "path": "repo/bert_0", "instances": 2}]
    models += [{"name": f"bert_{i}", "kind": "encoder", "path": f"repo/bert_{i}", "instances": 2,
                "resident": "on-demand", **({"idle_unload_s": idle} if idle else {})} for i in range(1, fine_tunes + 1)]
    path = tmp_path / "box.yaml"
    path.write_text(yaml.safe_dump({"name": "box", "gpus": {"count": 1}, "models": models,
                                    **({"swap_room_gib": swap_room_gib} if swap_room_gib else {})}))
    return path


def test_on_demand_entries_share_a_swap_room_and_the_plan_says_which_are_warm_together(tmp_path):
    bert = 2 * plan(load_deployment(_on_demand_box(tmp_path / "a", fine_tunes=1))).estimates["bert_1"].gib
    p = plan(load_deployment(_on_demand_box(tmp_path / "b", swap_room_gib=round(2.5 * bert, 3))))
    assert p.fits and p.on_demand == {f"bert_{i}": pytest.approx(bert) for i in range(1, 7)}
    assert p.swap_room_gib == round(2.5 * bert, 3) and p.warm_together == ["bert_1", "bert_2"]
    gpu = p.devices[0]
    assert [pl.model for pl in gpu.placements if pl.what == "instances"] == ["bert_0"]  # the always-resident one
    assert next(pl for pl in gpu.placements if pl.what == "swap room").gib == p.swap_room_gib
    table = format_plan(p)
    assert f"a swap room of {p.swap_room_gib:.2f} GiB on each GPU" in table
    assert "warm together: bert_1, bert_2 (2 of 6; the others swap in as they are asked for)" in table


def test_a_room_the_largest_on_demand_entry_cannot_fit_is_refused_with_the_numbers(tmp_path, capsys):
    from deploy.cli import plan_main

    path = _on_demand_box(tmp_path, swap_room_gib=0.1, fine_tunes=2)
    assert plan_main([str(path)]) == 2
    out = capsys.readouterr().out
    assert "DOES NOT FIT: over on the swap room: bert_1 needs" in out and "the room is 0.10 GiB" in out


def test_without_a_room_on_demand_entries_get_what_the_rest_leaves(tmp_path):
    p = plan(load_deployment(_on_demand_box(tmp_path, fine_tunes=3)))
    assert p.fits and p.devices[0].free_gib == pytest.approx(0) and p.swap_room_gib > max(p.on_demand.values())


def test_on_demand_entries_render_as_explicit_model_control_and_gateway_settings(tmp_path):
    d = load_deployment(_on_demand_box(tmp_path, fine_tunes=2, idle=600))
    p = plan(d)
    triton = build_services(d, p)[0]
    assert "--model-control-mode=explicit" in triton.args and "--load-model=bert_0" in triton.args
    assert not any(a.startswith("--load-model=bert_1") for a in triton.args) and "--strict-readiness=false" in triton.args
    settings = gateway_settings(d, Layout(), p)
    assert settings["required_models"] == ["llm", "bert_0"]
    assert settings["on_demand"]["bert_2"] == {"task": "text-classification", "gib": round(p.on_demand["bert_2"], 3),
                                               "idle_unload_s": 600}
    assert settings["swap_room_gib"] == round(p.swap_room_gib, 3)
    from serve.gateway.settings import GatewaySettings

    GatewaySettings.model_validate(settings)  # what the gateway reads at start


def test_every_entry_resident_keeps_triton_loading_all_of_them(boxes):
    d = load_deployment(boxes[0])
    triton = build_services(d, plan(d))[0]
    assert "--model-control-mode=none" in triton.args and "--strict-readiness=true" in triton.args
    assert "on_demand" not in gateway_settings(d, Layout(), plan(d))


def test_a_cpu_box_with_two_llm_variants_and_room_for_one_wakes_them_through_their_controls(tmp_path):
    from deploy.box import _process
    from tests.plan_fixtures import TINY_LLAMA

    for name in ("a", "b", "c"):
        write_llama(tmp_path / name, TINY_LLAMA)
    spec = {"name": "variants", "gpus": {"count": 0}, "models": [
        {"name": "always", "kind": "llm", "path": "c", "kv_cache_gib": 1},
        *({"name": f"variant-{n}", "kind": "llm", "path": n, "kv_cache_gib": 1, "resident": "on-demand"} for n in "ab")]}
    path = tmp_path / "box.yaml"
    path.write_text(yaml.safe_dump(spec))
    d = load_deployment(path)
    variant = plan(d).estimates["variant-a"].gib
    spec["swap_room_gib"] = round(1.5 * variant, 3)
    path.write_text(yaml.safe_dump(spec))
    d = load_deployment(path)
    p = plan(d)
    assert p.fits and p.on_demand == {"variant-a": variant, "variant-b": variant} and p.warm_together == ["variant-a"]
    assert [pl.model for pl in p.devices[0].placements if pl.what == "engine"] == ["always"]
    services = {s.name: s for s in build_services(d, p)}
    a = services["vllm-variant-a-0"]
    assert a.control_port == a.metrics_port + 1000 and a.port == a.control_port  # ready through its control, asleep
    assert services["vllm-always-0"].control_port is None
    settings = gateway_settings(d, Layout(), p)
    assert settings["on_demand"]["variant-a"]["engine"] == f"http://127.0.0.1:{a.metrics_port}"
    assert settings["engine_control"] == {f"http://127.0.0.1:{s.metrics_port}": f"http://127.0.0.1:{s.control_port}"
                                          for s in (a, services["vllm-variant-b-0"])}
    assert settings["required_models"] == ["always"]
    process = _process(a, tmp_path / "run", {"vllm": tmp_path / "env"}, None, "127.0.0.1")
    assert process.command[1:3] == ["-m", "serve.engine_control"]
    assert process.command[process.command.index("--port") + 1] == str(a.control_port)
    assert process.command[process.command.index("--") + 2] == "serve"  # then the engine's own `vllm serve ...`
    assert process.ready_url == f"http://127.0.0.1:{a.control_port}/health"
    from serve.gateway.settings import GatewaySettings

    GatewaySettings.model_validate(settings)
    from deploy.plan import cpu_binds

    # each always-resident engine its slice of the cores, the variants one they take turns in; one core: no binding
    assert cpu_binds(d, [0, 1, 2, 3]) == {"always": "0-1", "variant-a": "2-3", "variant-b": "2-3"}
    assert cpu_binds(d, [0]) == {}


def test_a_small_cpu_box_runs_each_unbound_engine_as_two_processes(tmp_path, monkeypatch):
    """Up to SMALL_BOX_CORES cores an engine runs with the model in its engine core (no worker process beside an engine
    core spinning on a core of its own); one bound to cores of its own keeps vLLM's worker, which applies the binding;
    a bigger box is left as vLLM runs it."""
    from serve.vllm_server import SMALL_BOX_CORES, TWO_PROCESSES
    from tests.plan_fixtures import TINY_LLAMA

    for name in ("a", "b"):
        write_llama(tmp_path / name, TINY_LLAMA)
    models = [{"name": n, "kind": "llm", "path": n, "kv_cache_gib": 1} for n in ("a", "b")]
    path = tmp_path / "box.yaml"

    def engines(cores: int, count: int = 1) -> dict[str, dict[str, str]]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        path.write_text(yaml.safe_dump({"name": "box", "gpus": {"count": 0}, "models": models[:count]}))
        d = load_deployment(path)
        return {s.name: s.env for s in build_services(d, plan(d)) if s.kind == "vllm"}

    layout = TWO_PROCESSES.items()
    assert all(layout <= env.items() for env in engines(2).values())
    assert all(layout <= env.items() for env in engines(SMALL_BOX_CORES).values())
    assert not any(layout & env.items() for env in engines(SMALL_BOX_CORES + 1).values())
    bound = engines(4, count=2)  # two always-resident engines on 4 cores: two cores each, bound
    assert [env["VLLM_CPU_OMP_THREADS_BIND"] for env in bound.values()] == ["0-1", "2-3"]
    assert not any(layout & env.items() for env in bound.values())


def test_what_a_promotion_retired_is_not_loaded_at_the_next_start(tmp_path):
    """`serve up` reads the models promotions retired from the box's rollout file (deploy/box.py): Triton runs under
    explicit model control loading the others, and a retired adapter is left out of its engine; status says what
    promotions moved."""
    from deploy.box_state import ROLLOUT_FILE
    from deploy.box_cli import _promotions
    from deploy.services import Layout, build_services
    from serve.gateway.fleet.rollout.store import RolloutStore, Snapshot
    from serve.gateway.settings import Alias
    from tests.plan_fixtures import TINY_LLAMA, write_adapter

    write_llama(tmp_path / "llm", TINY_LLAMA)
    d = parse_deployment({"name": "box", "models": [
        {"name": "reviews", "kind": "encoder", "path": str(write_entry(tmp_path / "repo", "reviews", target="cpu"))},
        {"name": "reviews-v2", "kind": "encoder", "path": str(write_entry(tmp_path / "repo", "reviews-v2", target="cpu"))},
        {"name": "llm", "kind": "llm", "path": "llm", "max_model_len": 512,
         "adapters": {v: str(write_adapter(tmp_path / v, config=TINY_LLAMA)) for v in ("support-v1", "support-v2")}}]},
        tmp_path)
    p = plan(d)
    retired = frozenset({"reviews", "support-v1"})
    triton, engine, _ = build_services(d, p, Layout(retired=retired))
    assert "--model-control-mode=explicit" in triton.args and "--load-model=reviews-v2" in triton.args
    assert "--load-model=reviews" not in triton.args
    assert "support-v2=" in " ".join(engine.args) and "support-v1=" not in " ".join(engine.args)
    everything, *_ = build_services(d, p, Layout())
    assert "--model-control-mode=none" in everything.args  # nothing retired: every entry loaded, as before
    RolloutStore(tmp_path / ROLLOUT_FILE).update(lambda s: s.routes.update(reviews=Alias(targets={"reviews-v2": 100}))
                                                 or s.retired.append("reviews"))
    assert _promotions(tmp_path) == ["promoted: reviews -> reviews-v2 (100 %)", "retired by promotions: reviews"]
    assert Snapshot() == RolloutStore(tmp_path / "elsewhere.json").read()


def _context_box(tmp_path, config: dict, max_model_len: int | None, tokenizer: dict | None = None):
    from tests.plan_fixtures import TINY_LLAMA

    write_llama(tmp_path / "llm", dict(TINY_LLAMA, **config))
    if tokenizer is not None:
        (tmp_path / "llm" / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return plan(parse_deployment({"name": "box", "models": [
        {"name": "llm", "kind": "llm", "path": "llm", **({"max_model_len": max_model_len} if max_model_len else {})}]},
        tmp_path))


def test_a_max_model_len_over_what_the_model_allows_is_refused_at_plan_time_as_vllm_would_at_its_start(tmp_path):
    """An on-demand engine starts only at its first request: a max_model_len vLLM refuses must be refused by the plan
    (`serve up` said the box was up, and the error came 34 s later). The limit is vLLM's: the smallest length key of
    the config, the tokenizer's model_max_length, a RoPE factor of a type whose config holds the unscaled length."""
    with pytest.raises(DeploymentError, match=r"models\.llm: max_model_len 1024 is over the 512 tokens the model allows "
                                              r"\(max_position_embeddings=512"):
        _context_box(tmp_path, {"max_position_embeddings": 512}, 1024)
    assert _context_box(tmp_path, {"max_position_embeddings": 512}, 512).estimates["llm"].context == 512
    assert _context_box(tmp_path, {"max_position_embeddings": 512}, None).estimates["llm"].context == 512  # the default
    with pytest.raises(DeploymentError, match=r"over the 256 tokens .*the tokenizer's model_max_length=256"):
        _context_box(tmp_path, {"max_position_embeddings": 512}, 300, tokenizer={"model_max_length": 256})
    huge = {"model_max_length": 1000000000000000019884624838656}  # transformers' "no limit"
    assert _context_box(tmp_path, {"max_position_embeddings": 512}, None, tokenizer=huge).estimates["llm"].context == 512
    linear = {"max_position_embeddings": 512, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert _context_box(tmp_path, linear, 2048).estimates["llm"].context == 2048
    with pytest.raises(DeploymentError, match=r"over the 2048 tokens .*x RoPE linear factor 4"):
        _context_box(tmp_path, linear, 2049)
    theta_only = {"max_position_embeddings": 512, "rope_parameters": {"rope_theta": 10000.0}}  # no scaling at all
    assert _context_box(tmp_path, theta_only, None).estimates["llm"].context == 512
    per_layer = {"max_position_embeddings": 512, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2}}}
    assert _context_box(tmp_path, per_layer, 1024).estimates["llm"].context == 1024
    llama3 = {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}  # prescaled
    with pytest.raises(DeploymentError, match="over the 8192 tokens"):
        _context_box(tmp_path, llama3, 8193)


def test_the_driver_floor_is_one_fact_the_docs_and_doctor_say_alike():
    """CUDA 13 (the pinned images') needs the R580 driver on a GeForce card: the docs, doctor and deploy/images.py
    name one figure (the docs said 575, CUDA 12.9's, and doctor passed R575 boxes that start neither image)."""
    from deploy.images import IMAGES_CUDA, MIN_DRIVER

    docs = (Path(__file__).parents[2] / "docs" / "deploy" / "first-boot.md").read_text()
    said = {int(n) for n in re.findall(r"driver of \**(\d{3})", docs)}
    assert said == {MIN_DRIVER} == {580} and IMAGES_CUDA == "13"

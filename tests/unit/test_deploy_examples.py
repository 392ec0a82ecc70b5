"""The deployment files in deploy/examples/ load, plan and render, on planning stand-ins laid out where each file
says its artifacts are; and a deployment with one model of every task the registry knows plans and renders, so
that the next task cannot break `plan` the way embeddings did."""

import shutil
from pathlib import Path

import pytest

from deploy.plan import format_plan, plan
from deploy.kubernetes import locust_job
from deploy.render import render
from deploy.spec import DeploymentError, load_deployment, parse_deployment
from core.tasks import TASKS
from tests.plan_fixtures import TINY_LLAMA, write_artifacts, write_diffusion_entry, write_entry, write_llama

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def test_the_examples_are_a_cpu_box_one_4090_and_four():
    assert [p.stem for p in EXAMPLES] == ["cpu-box", "four-4090", "one-4090"]
    for path in EXAMPLES:
        assert path.read_text().startswith("# "), f"{path.name}: a comment header says what it is and how to run it"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_loads_plans_and_renders(example, tmp_path):
    path = write_artifacts(Path(shutil.copy(example, tmp_path / example.name)))
    d = load_deployment(path)
    p = plan(d)
    assert p.fits, format_plan(p)
    if d.llms and not d.on_gpu:  # the CPU box runs with `serve up`; vLLM's images need a GPU
        with pytest.raises(DeploymentError, match="vLLM's images need a GPU"):
            render(d, tmp_path / "out", prefix=ROOT)
        return
    files = render(d, tmp_path / "out", prefix=ROOT)
    names = {f.relative_to(tmp_path / "out").as_posix() for f in files}
    assert {"compose/compose.yaml", "kubernetes/kustomization.yaml", f"systemd/rtxserve-{d.name}.target"} <= names


def test_one_4090_fills_the_gpu_with_classifier_instances_beside_the_engine_and_the_diffusion_model(tmp_path):
    example = next(p for p in EXAMPLES if p.stem == "one-4090")
    p = plan(load_deployment(write_artifacts(Path(shutil.copy(example, tmp_path / example.name)))))
    assert p.engines == {"llama-3-8b": [0]} and p.instances["reviews"] >= 1 and p.more["reviews"] == 0
    assert p.devices[0].free_gib < p.estimates["reviews"].gib  # "auto": as many as fit, then no room for one more


def every_task(tmp_path) -> list[dict]:
    """One model of every task in the registry, laid out as a deployment in `tmp_path` lists them."""
    models = []
    for task, t in TASKS.items():
        name = task.replace("-", "_")
        if t.kind == "encoder":
            write_entry(tmp_path / "model_repository", name, task=task,
                        meta={"embedding_size": 768} if task == "feature-extraction" else None)
        elif t.kind == "diffusion":
            write_diffusion_entry(tmp_path / "model_repository", name)
        elif t.kind == "llm":
            name = task
            write_llama(tmp_path / name, TINY_LLAMA)
        else:
            pytest.fail(f"task {task}: no planning stand-in for its kind {t.kind!r} (tests/plan_fixtures.py)")
        path = name if t.kind == "llm" else f"model_repository/{name}"
        models.append({"name": name, "kind": t.kind, "path": path, "task": task})
    (tmp_path / "keys.json").write_text("{}")
    return models


def deployment(models: list[dict], folder: Path):
    return parse_deployment({"name": "every-task", "gpus": {"count": 1}, "gateway": {"keys_file": "keys.json"},
                             "models": [{k: v for k, v in m.items() if k != "task"} for m in models]}, folder)


def test_a_deployment_with_one_model_of_every_task_plans_and_renders(tmp_path):
    models = every_task(tmp_path)
    d = deployment(models, tmp_path)
    p = plan(d)
    assert p.fits and set(p.estimates) == {m["name"] for m in models}, format_plan(p)
    assert render(d, tmp_path / "out", prefix=ROOT)


def test_the_rendered_load_test_job_drives_the_first_models_own_task(tmp_path):
    """The Kubernetes locust Job runs the scenario of the first model's task (an NER or embeddings model is not
    load-tested as a classifier)."""
    models = every_task(tmp_path)
    for first in models:
        d = deployment([first] + [m for m in models if m is not first], tmp_path)
        master = locust_job(d)[0]["spec"]["template"]["spec"]["containers"][0]["command"][-1]
        assert f"--scenario {TASKS[first['task']].loadtest[0]} --model {first['name']}" in master

"""export diffusion's checks on the tiny Stable Diffusion fixture: the pipeline's components, and a LoRA
against the UNet it was trained on (a LoRA for another base is named with the tensors that do not fit)."""

import shutil

import pytest

from export.diffusion import check_lora, check_pipeline, export_diffusion
from export.exceptions import ExportError
from export.fixtures import write_diffusion_lora, write_diffusion_pipeline
from export.triton_entry import EntryOptions


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd")
    pipe = write_diffusion_pipeline(root / "pipe")
    return pipe, write_diffusion_lora(pipe, root / "lora")


def test_a_pipeline_missing_a_component_is_named(pipeline, tmp_path):
    pipe, _ = pipeline
    broken = shutil.copytree(pipe, tmp_path / "broken")
    shutil.rmtree(broken / "vae")
    with pytest.raises(ExportError, match="the pipeline lacks vae"):
        check_pipeline(broken)
    with pytest.raises(ExportError, match="not a diffusers pipeline folder"):
        check_pipeline(tmp_path)


def test_a_lora_for_another_base_is_refused_with_the_tensors_that_do_not_fit(pipeline, tmp_path):
    pipe, lora = pipeline
    assert check_lora(pipe, lora) == ["unet"]
    other = write_diffusion_pipeline(tmp_path / "wider", channels=(64, 128))
    with pytest.raises(ExportError, match=r"does not fit the unet of .*wider: .*lora_A.weight has shape \[4, 64\], the base needs \[4, 128\]"):
        check_lora(other, lora)
    with pytest.raises(ExportError, match="does not fit"):  # and nothing is written
        export_diffusion(other, EntryOptions(name="sd"), tmp_path / "repo", lora_path=lora)
    assert not (tmp_path / "repo" / "sd").exists()


def test_the_entry_holds_the_pipeline_the_lora_and_the_defaults(pipeline, tmp_path):
    import json

    from serve.entry_config import read_config

    pipe, lora = pipeline
    (entry,) = export_diffusion(pipe, EntryOptions(name="sd", instances=2), tmp_path / "repo", lora_path=lora)
    config = read_config(entry / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["rtxserve_task"] == "text-to-image" and config.instance_group[0].count == 2
    assert json.loads(params["rtxserve_defaults"]) == {"steps": 25, "guidance": 7.5, "size": 16, "lora_scale": 1.0}
    assert (entry / "1" / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert (entry / "1" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_a_deployment_plans_the_pipeline_at_its_resolution(pipeline, tmp_path):
    from deploy.plan import plan
    from deploy.spec import parse_deployment

    pipe, lora = pipeline
    export_diffusion(pipe, EntryOptions(name="sd"), tmp_path / "repo", lora_path=lora)
    small = parse_deployment({"name": "box", "models": [{"name": "sd", "kind": "diffusion", "path": "repo/sd",
                                                         "instances": 2}]}, tmp_path)
    large = parse_deployment({"name": "box", "models": [{"name": "sd", "kind": "diffusion", "path": "repo/sd", "size": 512,
                                                         "max_images": 4}]}, tmp_path)
    p, q = plan(small), plan(large)
    assert p.fits and p.instances == {"sd": 2} and p.estimates["sd"].kind == "diffusion"
    assert q.estimates["sd"].parts["activations"] > 100 * p.estimates["sd"].parts["activations"]  # 32x the pixels, 4 images
    assert p.estimates["sd"].parts["weights"] == q.estimates["sd"].parts["weights"] > 0

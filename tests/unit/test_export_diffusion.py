"""export diffusion's checks on the tiny Stable Diffusion fixture: the pipeline's components, and a LoRA
against the UNet it was trained on (a LoRA for another base is named with the tensors that do not fit)."""

import shutil

import pytest

from deploy.plan import GIB
from export.diffusion.stable_diffusion import check_lora, check_pipeline, component_weights, export_diffusion
from core.lora import tensor_shapes
from export.exceptions import ExportError
from fixture_models.diffusion import write_diffusion_lora, write_diffusion_pipeline
from export.triton.entry import EntryOptions


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
    inpainting = shutil.copytree(pipe, tmp_path / "inpaint")
    index = (inpainting / "model_index.json").read_text().replace("StableDiffusionPipeline", "StableDiffusionInpaintPipeline")
    (inpainting / "model_index.json").write_text(index)
    with pytest.raises(ExportError, match="is a StableDiffusionInpaintPipeline; the entry serves StableDiffusionPipeline"):
        check_pipeline(inpainting)


def test_a_lora_folder_of_several_files_is_refused_rather_than_guessed(pipeline, tmp_path):
    _, lora = pipeline
    two = shutil.copytree(lora, tmp_path / "two")
    shutil.copy(two / "pytorch_lora_weights.safetensors", two / "checkpoint-500.safetensors")
    with pytest.raises(ExportError, match="holds 2 safetensors files .*name the LoRA file itself"):
        check_lora(pipeline[0], two)


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
    assert json.loads(params["rtxserve_defaults"]) == {"steps": 25, "guidance": 7.5, "size": 16, "lora_scale": 1.0,
                                                       "lora_fused": False}
    assert (entry / "1" / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert (entry / "1" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_a_deployment_plans_the_pipeline_at_its_resolution(pipeline, tmp_path):
    from deploy.plan import plan
    from deploy.load import parse_deployment

    pipe, lora = pipeline
    export_diffusion(pipe, EntryOptions(name="sd"), tmp_path / "repo", lora_path=lora)
    small = parse_deployment({"name": "box", "models": [{"name": "sd", "kind": "diffusion", "path": "repo/sd",
                                                         "instances": 2}]}, tmp_path)
    large = parse_deployment({"name": "box", "models": [{"name": "sd", "kind": "diffusion", "path": "repo/sd", "size": 512,
                                                         "max_images": 4}]}, tmp_path)
    p, q = plan(small), plan(large)
    assert p.fits and p.instances == {"sd": 2} and p.estimates["sd"].kind == "diffusion"
    # the fixture: 16x16 by default, a VAE that scales by 2, UNet channels 32; values in fp32 on CPU
    latent = (16 // 2) ** 2
    assert p.estimates["sd"].parts["activations"] * GIB == pytest.approx(2 * latent * 32 * 300 * 4 + 16 * 16 * 128 * 4)
    assert q.estimates["sd"].parts["activations"] * GIB == pytest.approx(
        2 * 4 * (512 // 2) ** 2 * 32 * 300 * 4 + 4 * 512 * 512 * 128 * 4)
    params = sum(__import__("math").prod(s) for c in ("unet", "vae", "text_encoder")
                 for s in tensor_shapes(component_weights(pipe / c)).values())
    assert p.estimates["sd"].parts["weights"] * GIB == pytest.approx(params * 4)


def test_compiling_a_unet_whose_lora_scale_requests_may_change_is_refused(pipeline, tmp_path):
    from export.diffusion.stable_diffusion import DiffusionDefaults

    pipe, lora = pipeline
    with pytest.raises(ExportError, match="--fuse-lora"):
        export_diffusion(pipe, EntryOptions(name="c"), tmp_path / "repo", lora_path=lora,
                         defaults=DiffusionDefaults(compile=True))
    assert not (tmp_path / "repo" / "c").exists()

"""`rtxserve export diffusion PIPELINE [--lora PATH]`: a fine-tuned Stable Diffusion pipeline (a diffusers
folder) as a Triton entry that the gateway serves on POST /v1/images/generations.

The pipeline folder is checked before anything is written: model_index.json and every component it names
(UNet, VAE, text encoder, tokenizer, scheduler config). A LoRA (diffusers' `save_lora_weights` file, as its
training scripts write) is checked tensor by tensor against the UNet's and text encoder's layers from their
safetensors headers (core/lora.py, the check the LLM and encoder exports use); a LoRA for another base is
refused with the tensors that do not fit. The entry is one python-backend model that loads the pipeline
(and the LoRA, at the scale set here or one a request chooses) and answers PNG bytes; the same seed and
parameters give the same image, the image `reference_image` makes in-process (the integration tests hold
the served bytes against it).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from core import contract, lora
from core.entry_metadata import entry_metadata_json
from core.reference import FILE as REFERENCE_FILE, ReferenceError
from core.weights import WeightsIndexError, safetensors_files

from ..exceptions import ExportError
from ..triton import repository
from ..triton.entry import PYTHON_MODELS, EntryOptions, ModelDir
from ..triton.model_config import InstanceGroup, ModelConfig, TensorSpec

log = logging.getLogger(__name__)

COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
# What the entry serves: text-to-image pipelines whose UNet denoises 4-channel latents (not inpainting's 9)
PIPELINES = ("StableDiffusionPipeline",)
# The weights a pipeline folder's components load by default (not their .fp16 / .non_ema variants)
WEIGHTS = ("diffusion_pytorch_model.safetensors", "model.safetensors")
LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' load_lora_weights looks for
# FP64 for the floats: an explicit 0.8 and the export's 0.8 are the same value, so the same image
INPUTS = (("PROMPT", "TYPE_STRING"), ("NEGATIVE_PROMPT", "TYPE_STRING"), ("STEPS", "TYPE_INT32"),
          ("GUIDANCE", "TYPE_FP64"), ("SEED", "TYPE_INT64"), ("WIDTH", "TYPE_INT32"), ("HEIGHT", "TYPE_INT32"),
          ("N", "TYPE_INT32"), ("SCHEDULER", "TYPE_STRING"), ("LORA_SCALE", "TYPE_FP64"))


@dataclass
class DiffusionDefaults:
    """What a request gets when it names no value; `size` is the UNet's native resolution unless given."""

    steps: int = 25
    guidance: float = 7.5
    size: int | None = None
    lora_scale: float = 1.0
    fuse_lora: bool = False  # fold the LoRA into the weights at lora_scale: no per-request scale, no LoRA cost per step
    compile: bool = False  # torch.compile the UNet when the entry loads (checked against the eager UNet here)
    min_cosine: float = 0.999  # the compiled UNet's outputs against the eager one's, on sample latents


def check_pipeline(path: Path) -> dict:
    """model_index.json, with every component present; raises ExportError naming what is missing."""
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise ExportError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
    try:
        index = json.loads(index_path.read_text())
    except ValueError as exc:
        raise ExportError(f"{index_path} is not valid JSON ({exc})") from None
    if index.get("_class_name") not in PIPELINES:
        raise ExportError(f"{path} is a {index.get('_class_name')}; the entry serves {', '.join(PIPELINES)} "
                          "(text to image: not inpainting, image to image or SDXL's two text encoders)")
    missing = [c for c in COMPONENTS if c not in index or not (path / c).is_dir()]
    if missing:
        raise ExportError(f"{path}: the pipeline lacks {', '.join(missing)} (model_index.json and its folders)")
    if not (path / "scheduler" / "scheduler_config.json").is_file():
        raise ExportError(f"{path}/scheduler has no scheduler_config.json")
    for c in ("unet", "vae", "text_encoder"):
        if not component_weights(path / c):
            raise ExportError(f"{path}/{c} has no {' or '.join(WEIGHTS)} (save the pipeline with safe_serialization=True)")
    if int(_config(path / "unet").get("in_channels", 4)) != 4:
        raise ExportError(f"{path}/unet takes {_config(path / 'unet').get('in_channels')} input channels: an inpainting "
                          "UNet; the entry serves text to image (4)")
    return index


def _config(component: Path) -> dict:
    try:
        return json.loads((component / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{component / 'config.json'} is missing or not JSON ({exc})") from None


def component_weights(component: Path) -> list[Path]:
    """The weights file(s) a component loads by default: one file, or the shards its index names."""
    for name in WEIGHTS:
        try:
            files = safetensors_files(component, name)
        except WeightsIndexError as exc:
            raise ExportError(str(exc)) from None
        if files:
            return files
    return []


def native_size(pipeline: Path) -> int:
    """The resolution the UNet was trained at: its sample size times the VAE's scale factor."""
    sample = _config(pipeline / "unet").get("sample_size", 64)
    sample = int(sample[0] if isinstance(sample, (list, tuple)) else sample)
    return sample * vae_scale(pipeline)


def vae_scale(pipeline: Path) -> int:
    return 2 ** (len(_config(pipeline / "vae").get("block_out_channels", [0])) - 1)


def lora_file(lora_path: Path) -> Path:
    """The one LoRA file a path names: the file, or the only safetensors file of a folder."""
    files = [lora_path] if lora_path.is_file() else sorted(lora_path.glob("*.safetensors"))
    if not files:
        raise ExportError(f"no LoRA safetensors at {lora_path} (diffusers' save_lora_weights writes {LORA_FILE})")
    if len(files) > 1:
        raise ExportError(f"{lora_path} holds {len(files)} safetensors files ({', '.join(f.name for f in files)}); "
                          "name the LoRA file itself")
    return files[0]


def check_lora(pipeline: Path, lora_path: Path) -> list[str]:
    """The components a LoRA adapts; ExportError naming the tensors that do not fit its layers."""
    files = [lora_file(lora_path)]
    try:
        shapes = lora.tensor_shapes(files)
    except Exception as exc:  # safetensors' own error types for a damaged file
        raise ExportError(f"{files[0]} is damaged or not safetensors ({exc})") from None
    adapted = []
    for component in ("unet", "text_encoder"):
        prefix = f"{component}."
        mine = {k.removeprefix(prefix): s for k, s in shapes.items() if k.startswith(prefix)}
        if not mine:
            continue
        try:
            base = lora.tensor_shapes(component_weights(pipeline / component))
        except Exception as exc:  # safetensors' own error types for a damaged file
            raise ExportError(f"{pipeline / component} holds damaged safetensors ({exc})") from None
        layers = lora.layers_from_weights(base, _config(pipeline / component))
        mismatch, modules = lora.misfits(mine, layers)
        if mismatch:
            raise ExportError(f"the LoRA {lora_path} does not fit the {component} of {pipeline}: "
                              + "; ".join(mismatch[:3]) + (f" and {len(mismatch) - 3} more" if len(mismatch) > 3 else ""))
        if modules:
            adapted.append(component)
    if not adapted:
        raise ExportError(f"{lora_path} holds no LoRA tensors for the UNet or the text encoder")
    return adapted


def diffusion_entry(opts: EntryOptions, pipeline: Path, lora_path: Path | None, defaults: DiffusionDefaults,
                    size: int, metadata: dict) -> ModelDir:
    kind = "KIND_GPU" if opts.target == "gpu" else "KIND_CPU"
    config = ModelConfig(
        name=opts.name, backend="python", max_batch_size=0,
        inputs=tuple(TensorSpec(n, t, (1,)) for n, t in INPUTS),
        outputs=(TensorSpec("IMAGES", "TYPE_STRING", (-1,)), TensorSpec("PROMPT_TRUNCATED", "TYPE_INT32", (1,))),
        instance_groups=(InstanceGroup(count=opts.instances, kind=kind, gpus=opts.gpus if kind == "KIND_GPU" else ()),),
        parameters={contract.PARAM_TASK: contract.TEXT_TO_IMAGE,
                    contract.PARAM_DEFAULTS: json.dumps({"steps": defaults.steps, "guidance": defaults.guidance,
                                                         "size": size,
                                                         "lora_scale": defaults.lora_scale if lora_path else None,
                                                         "lora_fused": bool(lora_path and defaults.fuse_lora)})},
    )
    files: dict[str, Path | str] = {"1/model.py": PYTHON_MODELS / "diffusion" / "model.py",
                                    "rtxserve.json": entry_metadata_json(metadata),
                                    "1/pipeline/model_index.json": pipeline / "model_index.json"}
    for component in COMPONENTS:  # what the pipeline loads: configs, tokenizer files, default weights
        for f in (pipeline / component).iterdir():
            if f.is_file() and (f.suffix != ".safetensors" and not f.name.endswith(".bin")
                                or f in component_weights(pipeline / component)):
                files[f"1/pipeline/{component}/{f.name}"] = f
            elif f.name.endswith(".index.json"):
                files[f"1/pipeline/{component}/{f.name}"] = f
    if lora_path is not None:
        files[f"1/lora/{LORA_FILE}"] = lora_file(lora_path)
    files["1/diffusion.json"] = json.dumps({"device": "cuda" if opts.target == "gpu" else "cpu",
                                            "dtype": "float16" if opts.target == "gpu" else "float32",
                                            "lora_scale": defaults.lora_scale, "lora_file": LORA_FILE,
                                            "fuse_lora": defaults.fuse_lora, "compile": defaults.compile,
                                            "size": size, "guidance": defaults.guidance,
                                            "schedulers": contract.SCHEDULERS}, indent=2)
    return ModelDir(config, files)


def reference_image(pipeline: Path, lora_path: Path | None, lora_scale: float, prompt: str, seed: int, steps: int,
                    size: int, guidance: float) -> bytes:
    """The first image of the pipeline run in-process, as PNG: what the entry must serve for these settings."""
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(pipeline, torch_dtype=torch.float32, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    if lora_path is not None:
        lora = lora_file(Path(lora_path))
        pipe.load_lora_weights(lora.parent, weight_name=lora.name, adapter_name="lora")
        pipe.set_adapters(["lora"], adapter_weights=[lora_scale])
    image = pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, width=size, height=size,
                 generator=[torch.Generator("cpu").manual_seed(seed)]).images[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _reference(pipeline: Path, lora_path: Path | None, defaults: DiffusionDefaults, size: int, opts: EntryOptions,
               eval_set: Path | None) -> tuple[str, dict]:
    """The entry's reference set (export/reference.py) and what rtxserve.json names it by. Served exactly where the
    entry runs what ran here (float32 on the CPU, eager, the LoRA at its scale); a GPU's fp16, a compiled UNet or a
    fused LoRA draw close to it, not to the bit (a lossy variant: looser defaults in `rtxserve eval`)."""
    from ..reference import eval_items

    variant = "-".join(v for v, on in (("gpu-fp16", opts.target == "gpu"), ("compiled", defaults.compile),
                                       ("fused-lora", bool(lora_path and defaults.fuse_lora))) if on) or "fp32"
    log.info("writing the reference set: the pipeline's own images of %s", eval_set or "two probe prompts")
    ref = image_reference(pipeline, eval_items(eval_set, contract.TEXT_TO_IMAGE), lora=lora_path,
                          lora_scale=defaults.lora_scale, guidance=defaults.guidance, size=size, steps=defaults.steps,
                          made_from=str(eval_set) if eval_set else "probes", variant=variant)
    try:
        return ref.dump()
    except ReferenceError as exc:
        raise ExportError(str(exc)) from None


# Image generation: the probes, and how large and long they are drawn (a reference, not a gallery: small and quick)
IMAGE_PROBES = ["a red square on grass", "a blue circle"]
IMAGE_MAX_SIZE, IMAGE_MAX_STEPS, IMAGE_SEED = 256, 8, 1234


def image_reference(pipeline: Path, items: list | None, *, lora: Path | None, lora_scale: float, guidance: float,
                    size: int, steps: int, made_from: str, variant: str):
    """A diffusion entry's reference: the pipeline run in-process (diffusers, float32 on the CPU) on each prompt with
    its seed, as the entry runs it: the PNG it must serve for the same request."""
    size, steps = min(size, IMAGE_MAX_SIZE), min(steps, IMAGE_MAX_STEPS)
    from core.reference import Item, ReferenceSet

    from ..reference import versions

    items = items or [Item(input={"prompt": p}) for p in IMAGE_PROBES]
    expected = []
    for item in items:
        i = item.input
        png = reference_image(pipeline, lora, lora_scale, i["prompt"], seed=i.get("seed", IMAGE_SEED),
                              steps=i.get("steps", steps), size=i.get("size", size), guidance=guidance)
        expected.append({"image": base64.b64encode(png).decode()})
    return ReferenceSet(task="text-to-image", framework=versions("diffusers", "torch"), source=str(pipeline.resolve()),
                        made_from=made_from, variant=variant,
                        settings={"size": size, "steps": steps, "seed": IMAGE_SEED, "guidance": guidance},
                        items=[i.model_copy(update={"expect": e}) for i, e in zip(items, expected)])


def check_compiled_unet(pipeline: Path, lora_path: Path | None, defaults: DiffusionDefaults, size: int) -> dict:
    """The UNet as the entry serves it (with its fused LoRA), compiled by torch.compile and run on seeded sample
    latents, timesteps and text states beside the eager UNet: min cosine and max abs difference of the noise
    predictions. ExportError below `defaults.min_cosine`."""
    import torch
    from diffusers import DiffusionPipeline

    from ..exceptions import ParityError

    pipe = DiffusionPipeline.from_pretrained(pipeline, torch_dtype=torch.float32, safety_checker=None)
    if lora_path is not None:
        lora = lora_file(lora_path)
        pipe.load_lora_weights(lora.parent, weight_name=lora.name, adapter_name="lora")
        pipe.fuse_lora(lora_scale=defaults.lora_scale)
        pipe.unload_lora_weights()
    unet = pipe.unet.eval()
    config = unet.config
    generator = torch.Generator("cpu").manual_seed(0)
    side = size // vae_scale(pipeline)
    # Called as the pipeline calls it for one image at the default size and guidance (classifier-free guidance
    # doubles the batch): the shape the entry compiles and warms at load, so that there its compile finds this
    # one's graphs in inductor's cache. Four seeded cases, one timestep each, as the denoising loop passes them.
    batch = 2 if defaults.guidance > 1 else 1
    timesteps = [999, 500, 100, 1]
    cases = [(torch.randn(batch, config.in_channels, side, side, generator=generator), torch.tensor(t)) for t in timesteps]
    states = torch.randn(batch, pipe.tokenizer.model_max_length, config.cross_attention_dim, generator=generator)

    def run(model) -> torch.Tensor:
        return torch.stack([model(x, t, encoder_hidden_states=states, timestep_cond=None, cross_attention_kwargs=None,
                                  added_cond_kwargs=None, return_dict=False)[0] for x, t in cases])

    with torch.no_grad():
        eager = run(unet)
        started = time.perf_counter()
        try:
            compiled = run(torch.compile(unet))
        except Exception as exc:  # inductor needs a C++ compiler (and Triton on CUDA); its errors are long
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            raise ExportError(f"torch.compile could not compile the UNet ({type(exc).__name__}: {first}); "
                              "export without --compile") from exc
        seconds = time.perf_counter() - started
    cosine = float(torch.nn.functional.cosine_similarity(eager.flatten(1), compiled.flatten(1)).min())
    # Checked here on the CPU in float32; a GPU entry compiles its float16 UNet on the GPU when it loads.
    figures = {"min_cosine": cosine, "max_abs_diff": float((eager - compiled).abs().max()), "cases": len(timesteps),
               "threshold": defaults.min_cosine, "compile_s": round(seconds, 1), "checked_on": "cpu, float32"}
    log.info("compiled UNet vs eager on %d sample latents: min cosine %.6f, max abs diff %.3g (compiled in %.0f s)",
             len(timesteps), cosine, figures["max_abs_diff"], seconds)
    if cosine < defaults.min_cosine:
        raise ParityError(f"the compiled UNet drifted from the eager one: min cosine {cosine:.6f} < {defaults.min_cosine}")
    return figures


def export_diffusion(pipeline: str | Path, opts: EntryOptions, repo: str | Path, *, lora_path: str | Path | None = None,
                     defaults: DiffusionDefaults | None = None, force: bool = False, command: str = "",
                     eval_set: Path | None = None, reference: bool = True) -> list[Path]:
    """Check the pipeline (and LoRA) and write the entry into `repo`, with its reference set (the pipeline run
    in-process on the eval set's prompts, or two probes, unless `reference` is False); returns the folders written."""
    pipeline, repo = Path(pipeline), Path(repo)
    defaults = defaults or DiffusionDefaults()
    if defaults.steps < 1 or defaults.guidance < 0 or not 0 <= defaults.lora_scale <= 4:
        raise ExportError(f"--steps must be >= 1, --guidance >= 0 and --lora-scale within 0..4, not {defaults}")
    lora_path = Path(lora_path) if lora_path else None
    if defaults.compile and lora_path and not defaults.fuse_lora:
        raise ExportError("--compile with an unfused LoRA: each LoRA scale a request asks for would compile the UNet "
                          "again; add --fuse-lora (one scale, folded into the weights)")
    repository.check_free(repo, [opts.name], force)
    index = check_pipeline(pipeline)
    adapted = check_lora(pipeline, lora_path) if lora_path else []
    native = native_size(pipeline)
    size = defaults.size or native
    if size < 8 or size % 8:
        raise ExportError(f"--size {size}: a positive multiple of 8 pixels")
    log.info("pipeline %s (%s), native %dx%d%s", pipeline, index.get("_class_name"), native, native,
             f", LoRA on {', '.join(adapted)}" if adapted else "")
    metadata = {"task": contract.TEXT_TO_IMAGE, "source": str(pipeline.resolve()), "pipeline": index.get("_class_name"),
                "target": opts.target, "instances": opts.instances, "native_size": native, "default_size": size,
                "vae_scale": vae_scale(pipeline), "command": command,
                "lora": {"path": str(lora_path.resolve()), "adapts": adapted, "scale": defaults.lora_scale} if lora_path else None,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if defaults.compile:
        metadata["unet_compile"] = check_compiled_unet(pipeline, lora_path, defaults, size)
    text = None
    if reference:
        text, metadata["reference"] = _reference(pipeline, lora_path, defaults, size, opts, eval_set)
    models = [diffusion_entry(opts, pipeline, lora_path, defaults, size, metadata)]
    if text is not None:
        models[0].files[REFERENCE_FILE] = text
    with repository.work_dir(repo) as work:
        written = repository.commit(repo, models, work, force)
    return written

"""Triton python-backend model: a diffusers text-to-image pipeline (with an optional LoRA) answering PNG bytes.

One request at a time per instance (max_batch_size 0; run more instances to run more at once). The UNet is
compiled with torch.compile at load when the export asked for it. Each image
gets its own seeded generator (seed, seed + 1, ...), so the same seed and parameters give the same images
whatever `n` is. A request that fails (out of memory included) fails alone: its error goes back in its
response and the instance keeps serving. A request whose client went away stops at the next step.
"""

import io
import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from diffusers import DiffusionPipeline


def _one(request, name):
    value = pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


class Cancelled(Exception):
    pass


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(here, "diffusion.json")) as f:
            self.settings = json.load(f)
        config = json.loads(args["model_config"])
        instances = sum(g.get("count", 1) for g in config.get("instance_group", [])) or 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // instances))  # instances share the cores
        device = self.settings["device"]
        if device == "cuda":
            device = f"cuda:{args.get('model_instance_device_id', 0)}"
        self.pipe = DiffusionPipeline.from_pretrained(os.path.join(here, "pipeline"),
                                                      torch_dtype=getattr(torch, self.settings["dtype"]),
                                                      safety_checker=None).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.lora = os.path.isdir(os.path.join(here, "lora"))
        if self.lora:
            self.pipe.load_lora_weights(os.path.join(here, "lora"), weight_name=self.settings["lora_file"],
                                        adapter_name="lora")
            self.lora_scale = None
            if self.settings.get("fuse_lora"):  # folded in once: no LoRA work per step, one scale for every request
                self.pipe.fuse_lora(lora_scale=self.settings["lora_scale"])
                self.pipe.unload_lora_weights()
                self.lora = False
        self.default_scheduler = self.pipe.scheduler
        self.max_tokens = self.pipe.tokenizer.model_max_length
        if self.settings.get("compile"):
            # Compiled here, at load, and run once as a default request of one image runs it (the default size and
            # guidance: with guidance the UNet sees a batch of two), so that "ready" means ready and neither the
            # gateway's first request (the same shape) nor a client waits for a compile. (The export checked the
            # compiled UNet against the eager one.) Another size or image count compiles once more. The stub's
            # embedded Python keeps the C locale whatever the environment says, so files open as ASCII, and
            # inductor's templates are UTF-8.
            import locale

            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
            self.pipe.unet = torch.compile(self.pipe.unet)
            size = self.settings["size"]
            self.pipe("", num_inference_steps=1, width=size, height=size, output_type="latent",
                      guidance_scale=self.settings.get("guidance", 7.5))

    def _scheduler(self, name):
        if not name:
            return self.default_scheduler
        import diffusers

        return getattr(diffusers, self.settings["schedulers"][name]).from_config(self.default_scheduler.config)

    def _generate(self, request):
        prompt = _one(request, "PROMPT")
        negative = _one(request, "NEGATIVE_PROMPT") or None
        n, seed = int(_one(request, "N")), int(_one(request, "SEED"))
        if self.lora:
            scale = float(_one(request, "LORA_SCALE"))
            scale = self.settings["lora_scale"] if scale < 0 else scale
            if scale != self.lora_scale:
                self.pipe.set_adapters(["lora"], adapter_weights=[scale])
                self.lora_scale = scale
        self.pipe.scheduler = self._scheduler(_one(request, "SCHEDULER"))
        tokens = len(self.pipe.tokenizer(prompt).input_ids)  # the pipeline truncates to the encoder's length

        def stop_if_gone(pipe, step, timestep, kwargs):
            if getattr(request, "is_cancelled", lambda: False)():
                raise Cancelled()
            return kwargs

        images = self.pipe(prompt, negative_prompt=negative, num_inference_steps=int(_one(request, "STEPS")),
                           guidance_scale=float(_one(request, "GUIDANCE")), width=int(_one(request, "WIDTH")),
                           height=int(_one(request, "HEIGHT")), num_images_per_prompt=n,
                           generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(n)],
                           callback_on_step_end=stop_if_gone).images
        pngs = []
        for image in images:
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            pngs.append(buffer.getvalue())
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("IMAGES", np.array(pngs, dtype=np.object_)),
            pb_utils.Tensor("PROMPT_TRUNCATED", np.array([max(0, tokens - self.max_tokens)], dtype=np.int32))])

    def execute(self, requests):
        responses = []
        for request in requests:
            error = None
            try:
                responses.append(self._generate(request))
                continue
            except torch.OutOfMemoryError:
                error = pb_utils.TritonError("out of memory for this request: ask for fewer or smaller images",
                                             pb_utils.TritonError.INVALID_ARG)
            except Cancelled:
                error = pb_utils.TritonError("the client went away",
                                             getattr(pb_utils.TritonError, "CANCELLED", pb_utils.TritonError.UNAVAILABLE))
            except (ValueError, KeyError) as exc:
                error = pb_utils.TritonError(str(exc)[:300], pb_utils.TritonError.INVALID_ARG)
            if torch.cuda.is_available():  # outside the except block: its traceback no longer holds the tensors
                torch.cuda.empty_cache()
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses

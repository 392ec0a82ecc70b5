"""Triton python-backend model: a diffusers text-to-image pipeline (with an optional LoRA) answering PNG bytes.

One request at a time per instance (max_batch_size 0; run more instances to run more at once). Each request
gets its own seeded generator, so the same seed and parameters give the same image. A request that fails
(out of memory included) fails alone: its error goes back in its response and the instance keeps serving.
"""

import io
import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from diffusers import DiffusionPipeline


def _one(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(here, "diffusion.json")) as f:
            self.settings = json.load(f)
        device = self.settings["device"]
        if device == "cuda":
            device = f"cuda:{args.get('model_instance_device_id', 0)}"
        self.device = device
        self.pipe = DiffusionPipeline.from_pretrained(os.path.join(here, "pipeline"),
                                                      torch_dtype=getattr(torch, self.settings["dtype"]),
                                                      safety_checker=None).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.lora = os.path.isdir(os.path.join(here, "lora"))
        if self.lora:
            self.pipe.load_lora_weights(os.path.join(here, "lora"), adapter_name="lora")
            self.lora_scale = None
        self.default_scheduler = self.pipe.scheduler
        self.max_tokens = self.pipe.tokenizer.model_max_length

    def _scheduler(self, name):
        if not name:
            return self.default_scheduler
        import diffusers

        cls = getattr(diffusers, self.settings["schedulers"][name])
        return cls.from_config(self.default_scheduler.config)

    def _generate(self, request):
        prompt = _one(request, "PROMPT")
        negative = _one(request, "NEGATIVE_PROMPT", "") or None
        n = int(_one(request, "N", 1))
        scale = float(_one(request, "LORA_SCALE", -1.0))
        if self.lora:
            scale = self.settings["lora_scale"] if scale < 0 else scale
            if scale != self.lora_scale:
                self.pipe.set_adapters(["lora"], adapter_weights=[scale])
                self.lora_scale = scale
        self.pipe.scheduler = self._scheduler(_one(request, "SCHEDULER", ""))
        tokens = len(self.pipe.tokenizer(prompt).input_ids)  # the pipeline truncates to the encoder's length
        generator = torch.Generator("cpu").manual_seed(int(_one(request, "SEED")))
        images = self.pipe(prompt, negative_prompt=negative, num_inference_steps=int(_one(request, "STEPS")),
                           guidance_scale=float(_one(request, "GUIDANCE")), width=int(_one(request, "WIDTH")),
                           height=int(_one(request, "HEIGHT")), num_images_per_prompt=n, generator=generator).images
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
            try:
                responses.append(self._generate(request))
            except torch.OutOfMemoryError:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "out of memory for this request: ask for fewer or smaller images", pb_utils.TritonError.UNAVAILABLE)))
            except (ValueError, KeyError) as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    str(exc)[:300], pb_utils.TritonError.INVALID_ARG)))
        return responses

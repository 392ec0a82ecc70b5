"""Image generation (`rtxserve export diffusion`): a Stable Diffusion pipeline, with its LoRA, as a Triton entry
(stable_diffusion.py; the served model is triton/python_models/diffusion/)."""

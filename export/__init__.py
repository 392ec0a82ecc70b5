"""Turn fine-tuned checkpoints into deployable artifacts (ONNX, validated) and Triton entries.

Nothing here imports the rest of rtxserve: `serve/` reads what export writes, never its code.

A folder per family of models, the pieces they share at the top:

    encoders/     text and image encoders (classify, NER, embeddings, vision, DETR): ONNX -> Triton ensemble
    detection/    object detectors: the DETR family's additions, Ultralytics YOLO (run in its own environment)
    llm/          LLMs and LoRA adapters for vLLM: full, LoRA, merged, converted, quantised (llm-compressor)
    speech/       Whisper fine-tunes for vLLM
    diffusion/    Stable Diffusion pipelines as a Triton python-backend entry
    trainers/     what trainers write (LLaMA-Factory runs, DeepSpeed ZeRO, Megatron) -> Hugging Face folders
    triton/       the Triton entry writer: model configs, the repository, the python-backend models it copies
    tensorrt/     ONNX -> TensorRT plan and its tensorrt_plan model (GPU machines)

Shared: cli.py (`rtxserve export`), exceptions.py, checkpoint.py (a checkpoint folder and its files),
lora_adapter.py (a PEFT LoRA adapter folder and its base), onnx_export.py, variants.py (fused / int8 / fp16 graphs),
parity.py, activations.py, vision.py (image processors and sample images), tool_env.py (steps run in a tool's own
environment), progress.py.
Imports between these rooms run one way, with no cycle in a folder or between folders: the families stand on the
shared pieces, triton/ and tensorrt/; encoders/ on detection/ (the detectors it exports) and trainers/ (ZeRO), llm/ on
trainers/, speech/ on llm/package.py.
"""

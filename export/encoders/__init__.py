"""Encoders: a fine-tuned text or image encoder -> validated ONNX (or a TensorRT plan) -> a Triton ensemble entry.

encoder.py is the one pipeline every encoder task runs (`rtxserve export onnx`); task_specs.py holds the encoder
tasks (ENCODER_TASKS: the registry's tasks, each with what it adds to the pipeline: outputs, wrapping, Triton models,
metadata) and the checkpoint each needs; inputs.py the sample inputs, made as the entry's first step makes them;
adapters.py PEFT LoRA adapters on encoders, checked against their base and merged.
"""

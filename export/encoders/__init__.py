"""Encoders: a fine-tuned text or image encoder -> validated ONNX (or a TensorRT plan) -> a Triton ensemble entry.

encoder.py is the one pipeline every encoder task runs (`rtxserve export onnx`); task_specs.py holds what each task
adds to it (outputs, wrapping, Triton models, metadata); inputs.py the sample inputs, made as the entry's first
step makes them; adapters.py PEFT LoRA adapters on encoders, checked against their base and merged.
"""

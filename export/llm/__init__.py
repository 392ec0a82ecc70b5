"""LLMs for vLLM (`rtxserve export llm`): llm.py checks and packages a full fine-tune, packages or merges a LoRA
adapter, converts a trainer's checkpoint; quantize.py quantises with llm-compressor in its own environment
(llmcompressor_runner.py runs there).
"""

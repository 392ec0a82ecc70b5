"""LLMs for vLLM (`rtxserve export llm`): full fine-tunes and LoRA / QLoRA adapters packaged (or merged) for vLLM,
trainers' checkpoints converted, quantised variants made, each checked against the model it came from.

One way down, no module importing one above it:

    llm.py             the entry, export_llm: the paths checked, then one of the two below
    quantize.py        the full-precision model quantised with llm-compressor, in llm-compressor's own environment
                       (llmcompressor_runner.py runs there)
    full_precision.py  a full fine-tune packaged, a LoRA adapter packaged for vLLM or merged, a trainer's
                       checkpoint converted (export/trainers/)
    checks.py          what a source must be: a checkpoint vLLM serves, an adapter that fits its base
    options.py         LLMOptions, what the export takes beside its source and output
    package.py         the folder every LLM package (and speech's) is built as: weights, side files, chat
                       template, rtxserve.json, renamed into place at the end
"""

"""Turn fine-tuned checkpoints into deployable artifacts (ONNX, validated) and Triton entries.

Nothing here imports the rest of rtxserve: `serve/` reads what export writes, never its code.
"""

"""TensorRT (GPU machines): an ONNX graph built into a plan, validated like the ONNX variants, and served as the
entry's tensorrt_plan model (plan.py)."""

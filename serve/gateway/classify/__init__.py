"""`/v1/classify`: text and image classification by a Triton entry (the hot path serves it: edge/hotpath.py)."""

"""`/v1/embeddings`: OpenAI's embeddings API over a Triton entry (the hot path serves it: edge/hotpath.py)."""

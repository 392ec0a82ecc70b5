"""Rerankers over vLLM: `/v1/rerank`, Cohere's `/v2/rerank`, `/v1/score`, and vLLM's pooling and classify routes."""

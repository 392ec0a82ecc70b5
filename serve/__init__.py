"""Run the servers: tritonserver, vLLM, and the FastAPI gateway in front of them.

Reads what export wrote (the model repository and its configs), never export's code; the gateway
never imports torch, transformers, vLLM or Triton's server code.
"""

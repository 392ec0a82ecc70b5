"""What trainers write, made a Hugging Face folder: runs.py recognises a run (LLaMA-Factory, Hugging Face Trainer) and
its layout; zero.py consolidates DeepSpeed ZeRO shards (zero_reference.py is its parity reference, run by torchrun);
megatron.py converts Megatron-core torch_dist checkpoints. The LLM and encoder exports both use them.
"""

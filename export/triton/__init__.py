"""The Triton entry writer: typed model configs rendered through Triton's schema (model_config.py), the models of one
entry (entry.py), written into a repository all at once or not at all (repository.py). python_models/ holds the
python-backend models entries copy (tokenizer, pre- and post-processing, ONNX on CPU, diffusion).
"""

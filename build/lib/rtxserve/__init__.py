"""rtxserve: export, serve and load-test fine-tuned models on your own boxes."""

__version__ = "0.1.0"

"""rtxserve: export, serve and load-test fine-tuned models on your own boxes. This package is the roof (the
CLI, the demo, the tuner); the shared facts live in core/."""

from core import __version__  # noqa: F401

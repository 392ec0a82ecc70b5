"""The ground floor every rtxserve package stands on: the task registry, the export<->serve contract (entry
parameters, rtxserve.json, model kinds, ports, limits, metric names), LoRA adapter reading with its one fit
check, the environments' locations and the version. It imports nothing else of ours; export/, serve/ and
loadtest/ import only it, deploy/ may import serve/ and export/ too, and the CLI, demo, tuner and benchmarks
sit on top (tests/unit/test_layering.py holds the rule)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rtxserve")  # declared once, in pyproject.toml
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"

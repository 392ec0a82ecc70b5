"""Facts that drift when typed twice are declared once in core/ and read everywhere else: the default ports and
the largest batch (core/contract.py), the gateway's metric names (core/metric_names.py). This test reads every
module of ours for a second copy."""

import ast
import re
from pathlib import Path

from core import contract, metric_names

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "export", "serve", "loadtest", "deploy", "fixture_models", "rtxserve", "bench")
PORTS = {contract.GATEWAY_PORT, contract.TRITON_HTTP_PORT, contract.TRITON_GRPC_PORT, contract.TRITON_METRICS_PORT,
         contract.VLLM_PORT}
METRIC = re.compile(r"\brtxserve_[a-z_]+")


def modules():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            yield path.relative_to(REPO), ast.parse(path.read_text())


def test_ports_are_numbers_only_in_the_contract():
    found = [f"{path}:{node.lineno}: {node.value}" for path, tree in modules() if path != Path("core/contract.py")
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and type(node.value) is int and node.value in PORTS]
    assert not found, "\n".join(found)


def test_the_batch_limit_is_a_number_only_in_the_contract():
    limit = str(contract.MAX_BATCH_SIZE)
    found = [f"{path}:{n}: {line.strip()}" for path, _ in modules() if path != Path("core/contract.py")
             for n, line in enumerate((REPO / path).read_text().splitlines(), 1) if limit in line and "batch" in line.lower()]
    assert not found, "\n".join(found)


def test_metric_names_are_strings_only_in_metric_names():
    declared = {v for k, v in vars(metric_names).items() if k.isupper()}
    found = [f"{path}:{node.lineno}: {name}" for path, tree in modules() if path != Path("core/metric_names.py")
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             for name in METRIC.findall(node.value) if any(name.startswith(d) for d in declared)]
    assert not found, "\n".join(found)


def test_release_pins_are_typed_once():
    """The NGC release in deploy/images.py only; vLLM's and torch's versions only in the requirements files and
    the Makefile, and ours only in pyproject.toml, which the code reads (never a copy to string-replace)."""
    from deploy import images

    from core import __version__

    typed = {images.NGC_RELEASE: Path("deploy/images.py"), images.VLLM_VERSION: None, "2.13.0": None, __version__: None}
    found = [f"{path}:{node.lineno}: {node.value}" for path, tree in modules()
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             for pin, home in typed.items() if pin in node.value and path != home]
    assert not found, "\n".join(found)


def test_entry_parameter_names_are_strings_only_in_the_contract():
    """The keys export writes into an entry's config and serve reads back (task, labels, max length, TensorRT...)."""
    declared = {v for k, v in vars(contract).items() if k.startswith("PARAM_")}
    found = [f"{path}:{node.lineno}: {node.value}" for path, tree in modules() if path != Path("core/contract.py")
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in declared]
    assert not found, "\n".join(found)

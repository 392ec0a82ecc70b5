"""Tiers by folder: tests/unit (in-process), tests/integration (real servers), tests/gpu (CUDA only), tests/boot
(rendered deployments booted with Docker Engine and systemd-nspawn: `make test-boot`, not `make test`).

The marker of each tier is applied here, so `pytest -m unit` etc. select by tier; gpu tests are
skipped where no NVIDIA GPU is visible.
"""

import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "gpu", "boot")


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def pytest_collection_modifyitems(config, items):
    gpu = None
    for item in items:
        parts = Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if "gpu" in parts:
            gpu = _has_gpu() if gpu is None else gpu
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on this 2-core box), torch in each worker computes on one
    thread: two workers training fixtures side by side with torch's default of a thread per core spun four threads on
    two cores, and each build took 7 to 12 times as long as with one thread each (the reranker 99 s against 15 s, the
    DETR 111 s against 9 s, side by side on a 2-core AVX2 EPYC). The servers the tests start choose their own threads."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_sessionstart(session):
    """Tests kill Triton on purpose (and a run cut short kills it too): each killed server leaves its python
    stubs' shared-memory regions in /dev/shm, which is RAM. Left to pile up, they starved later runs' vLLM of
    memory; what no process maps any more goes before and after every run."""
    from serve.triton_server import remove_orphaned_regions

    remove_orphaned_regions()


def pytest_sessionfinish(session):
    pytest_sessionstart(session)
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its waits go to the controller's summary
        session.config.workeroutput["built_waits"] = _WAITS


_SECONDS: dict[str, Counter] = {"tier": Counter(), "module": Counter()}
_SPANS: dict[str, list[float]] = {}  # test worker: [first phase's start, last phase's stop, seconds in phases]
_WAITS: dict[str, float] = {}  # built_once: seconds this process waited for another worker's build, by name


def pytest_runtest_logreport(report):
    """Every phase's seconds (set-up included: that is where the servers start), by tier, by module and by worker."""
    parts = report.nodeid.split("::")[0].split("/")
    _SECONDS["tier"][next((t for t in TIERS if t in parts), "other")] += report.duration
    _SECONDS["module"][parts[-1]] += report.duration
    node = getattr(report, "node", None)
    span = _SPANS.setdefault(node.gateway.id if node is not None else "main", [report.start, report.stop, 0.0])
    span[0], span[1], span[2] = min(span[0], report.start), max(span[1], report.stop), span[2] + report.duration


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for name, seconds in node.workeroutput.get("built_waits", {}).items():
        _WAITS[f"{name} ({node.gateway.id})"] = seconds


def pytest_terminal_summary(terminalreporter):
    """Where the time went: per tier, the ten slowest modules (README's "Testing" keeps the table), each test worker's
    span and the time it sat idle after its last test while another ran on, and the waits for another worker's
    fixture builds (a worker blocked on a lock is a core unused)."""
    if not _SECONDS["tier"]:
        return
    write = terminalreporter.write_line
    terminalreporter.section("seconds per tier and slowest modules (set-up, call and tear-down)")
    for tier, seconds in _SECONDS["tier"].most_common():
        write(f"{seconds:8.1f}s  {tier}")
    for module, seconds in _SECONDS["module"].most_common(10):
        write(f"{seconds:8.1f}s  {module}")
    if len(_SPANS) > 1:
        end = max(stop for _, stop, _ in _SPANS.values())
        for worker, (start, stop, busy) in sorted(_SPANS.items()):
            write(f"{worker}: {stop - start:7.1f}s from its first test to its last, {busy:7.1f}s in tests, "
                  f"idle {end - stop:6.1f}s at the end")
    for name, seconds in sorted(_WAITS.items(), key=lambda w: -w[1])[:10]:
        if seconds >= 1:
            write(f"{seconds:8.1f}s  waited for another worker to build {name}")


def built_once(tmp_path_factory, name: str, build) -> Path:
    """What `build(folder)` returns, built once per test run: under pytest-xdist (`make test` runs two workers) the
    first worker to ask builds it in the run's folder that the workers share, under a file lock, and the others read
    it there; alone, it is built in the session's folder. A build that failed half-way is started again."""
    import os
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "built"
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / name, root / f"{name}.built"
    asked = time.monotonic()
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            done.write_text(str(build(folder)))
        else:
            _WAITS[name] = _WAITS.get(name, 0.0) + time.monotonic() - asked
    return Path(done.read_text())


@pytest.fixture(scope="session")
def classifier_checkpoint(tmp_path_factory) -> Path:
    """The fixture BERT classifier (trained until it labels its probes with a margin)."""
    from fixture_models.text import write_text_classifier

    return built_once(tmp_path_factory, "text-classifier", write_text_classifier)


@pytest.fixture(scope="session")
def ner_checkpoint(tmp_path_factory) -> Path:
    """The fixture BERT NER tagger (BIO tags for PER / LOC / ORG; names split into sub-words)."""
    from fixture_models.text import write_ner_tagger

    return built_once(tmp_path_factory, "ner-tagger", write_ner_tagger)

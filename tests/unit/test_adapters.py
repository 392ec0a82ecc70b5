"""deploy/adapters.py: what `rtxserve adapters add|remove` refuses before loading anything, how a refusal on one
replica is undone on the others (serve/lora_runtime.py), and that the deployment file keeps its comments (the loads
themselves, on a real vLLM under load: tests/integration/test_serve_up.py)."""

import pytest
import yaml

from serve import lora_runtime
from deploy.adapters import add_adapter, remove_adapter
from deploy.spec import DeploymentError
from tests.plan_fixtures import LLAMA_3_8B, TINY_LLAMA, write_adapter, write_llama

HEAD = "# my box: hand-written, keep this comment\n"
PORT = 8100


@pytest.fixture
def box(tmp_path):
    write_llama(tmp_path / "llm", TINY_LLAMA)
    write_adapter(tmp_path / "support", rank=16, config=TINY_LLAMA)
    spec = {"name": "box", "gpus": {"count": 2}, "ports": {"vllm": PORT},
            "models": [{"name": "llm", "kind": "llm", "path": "llm", "adapters": {"support": "support"}, "replicas": 2}]}
    path = tmp_path / "deployment.yaml"
    path.write_text(HEAD + yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def engines(monkeypatch):
    """The replicas' runtime LoRA API, faked: what each was asked, and what the second one answers."""
    asked, second = [], {"why": None}

    def post(url, path, body):
        asked.append((int(url.rsplit(":", 1)[1]) - PORT, path, body["lora_name"]))
        return second["why"] if url.endswith(str(PORT + 1)) else None

    monkeypatch.setattr(lora_runtime, "_post", post)
    return asked, second


@pytest.mark.parametrize("name, adapter, rank, config, message", [
    ("support", "new", 16, TINY_LLAMA, "support is already served by deployment box (by models.llm)"),
    ("llm", "new", 16, TINY_LLAMA, "llm is already served"),
    ("b", "missing", None, None, "adapter b:"),
    ("b", "new", 16, LLAMA_3_8B, "adapter b:"),  # another base's shapes
    ("b", "new", 64, TINY_LLAMA, "adapter b has rank 64; the engines of llm were started for ranks up to 16"),
])
def test_bad_adapters_are_refused_in_one_line_before_any_engine_is_asked(box, engines, tmp_path, name, adapter, rank,
                                                                         config, message):
    path = box
    if rank is not None:
        write_adapter(tmp_path / adapter, rank=rank, config=config)
    before = path.read_text()
    with pytest.raises(DeploymentError) as refused:
        add_adapter(path, name, tmp_path / adapter)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert path.read_text() == before and engines[0] == []


def test_one_replica_refusing_unloads_it_from_the_other_and_leaves_the_file(box, engines, tmp_path):
    asked, second = engines
    write_adapter(tmp_path / "b", rank=8, config=TINY_LLAMA)
    second["why"] = "http://127.0.0.1:8101 answered 400: boom"
    with pytest.raises(DeploymentError, match="adapter b not loaded: http://127.0.0.1:8101 answered 400: boom"):
        add_adapter(box, "b", tmp_path / "b")
    assert asked == [(0, "/v1/load_lora_adapter", "b"), (1, "/v1/load_lora_adapter", "b"),
                     (0, "/v1/unload_lora_adapter", "b")]
    assert "b:" not in box.read_text()


def test_add_then_remove_asks_every_replica_and_keeps_the_files_comment(box, engines, tmp_path):
    asked, _ = engines
    write_adapter(tmp_path / "b", rank=8, config=TINY_LLAMA)
    add_adapter(box, "b", tmp_path / "b")
    assert box.read_text().startswith(HEAD)
    assert yaml.safe_load(box.read_text())["models"][0]["adapters"] == {"support": "support", "b": "b"}
    remove_adapter(box, "b")
    with pytest.raises(DeploymentError, match="serves no adapter named b"):
        remove_adapter(box, "b")
    assert [(replica, what) for replica, what, _ in asked] == [
        (0, "/v1/load_lora_adapter"), (1, "/v1/load_lora_adapter"), (0, "/v1/unload_lora_adapter"),
        (1, "/v1/unload_lora_adapter")]
    assert box.read_text().startswith(HEAD)
    assert yaml.safe_load(box.read_text())["models"][0]["adapters"] == {"support": "support"}

"""`rtxserve adapters add|remove`: a LoRA adapter loaded into, or unloaded from, a running deployment's engines without a
restart, and written into (or out of) its deployment file, so that `serve up` brings the same set back.

On the box that runs the deployment. An adapter is checked first, against the base model its entry serves, by the one
LoRA fit check (core.lora, through serve.vllm_server.check_adapter_base) and against the largest rank the engines were
started for; then each replica's vLLM loads it through its runtime LoRA API (serve.lora_runtime: on every replica or
on none). The gateway lists the adapter at its next discovery (every
`health_interval_s`), and streams in flight are not touched: vLLM loads an adapter beside the running batch.

The deployment file is edited in place with ruamel.yaml's round trip, so its comments and order stay as written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from core.contract import padded_lora_rank
from serve.lora_runtime import RuntimeLoraError, load_everywhere, unload_everywhere
from serve.vllm_server import VLLMConfigError, check_adapter_base, read_adapter

from .spec import Deployment, DeploymentError, LLMModel, SpeechModel

from .load import load_deployment

def _served_names(d: Deployment) -> dict[str, str]:
    """Every name a client may call -> the deployment entry serving it."""
    out = {}
    for m in d.models:
        out[m.name] = m.name
        for adapter in getattr(m, "adapters", {}) or {}:
            out[adapter] = m.name
    return out


def _base(d: Deployment, base: str | None) -> LLMModel:
    llms = [m for m in d.vllm_models if not isinstance(m, SpeechModel)]
    if base is not None:
        found = next((m for m in llms if m.name == base), None)
        if found is None:
            raise DeploymentError(f"--base {base}: no LLM of that name in deployment {d.name} "
                                  f"(its LLMs: {', '.join(m.name for m in llms) or 'none'})")
        return found
    if len(llms) != 1:
        raise DeploymentError(f"deployment {d.name} has {len(llms)} LLMs ({', '.join(m.name for m in llms) or 'none'}): "
                              "name the base with --base")
    return llms[0]


def _engines(d: Deployment, m: LLMModel) -> list[str]:
    return [f"http://127.0.0.1:{port}" for model, _, port in d.engines() if model.name == m.name]


def add_adapter(deployment: Path, name: str, path: Path, base: str | None = None) -> LLMModel:
    """Check the adapter at `path` (relative paths: to the working directory), load it as `name` on every engine of the
    base, write it into `deployment` (relative to the file where it lies under the file's folder).
    Raises DeploymentError (one line; nothing loaded) on a taken name, a path that is not an adapter for this base,
    an adapter over the engines' rank, or an engine that refuses it."""
    d = load_deployment(deployment)
    m = _base(d, base)
    taken = _served_names(d)
    if name in taken:
        raise DeploymentError(f"{name} is already served by deployment {d.name} (by models.{taken[name]}); pick "
                              "another name, or remove it first")
    folder = Path(path).resolve()
    try:
        adapter = read_adapter(name, folder)
        check_adapter_base(adapter, d.resolve(m.path))
        started = [read_adapter(a, d.resolve(p)) for a, p in m.adapters.items()]
    except VLLMConfigError as exc:
        raise DeploymentError(str(exc)) from None
    if not started:
        raise DeploymentError(f"models.{m.name} was started without LoRA (it lists no adapters): add this adapter to "
                              "its `adapters:` and run `serve up` again, after which adapters load without a restart")
    slots = padded_lora_rank(max(a.rank for a in started))
    if padded_lora_rank(adapter.rank) > slots:
        raise DeploymentError(f"adapter {name} has rank {adapter.rank}; the engines of {m.name} were started for ranks "
                              f"up to {slots} (their largest adapter's): add it to the deployment file and `serve up` "
                              "again")
    try:
        load_everywhere(_engines(d, m), name, str(folder))
    except RuntimeLoraError as exc:
        raise DeploymentError(str(exc)) from None
    written = os.path.relpath(folder, d.base_dir) if folder.is_relative_to(d.base_dir) else str(folder)
    _edit(deployment, lambda data: _entry(data, m.name).setdefault("adapters", {}).__setitem__(name, written))
    return m


def remove_adapter(deployment: Path, name: str) -> LLMModel:
    """Unload the adapter `name` from every engine that serves it and take it out of `deployment`."""
    d = load_deployment(deployment)
    m = next((m for m in d.vllm_models if name in m.adapters), None)
    if m is None:
        raise DeploymentError(f"deployment {d.name} serves no adapter named {name} "
                              f"(its adapters: {', '.join(a for x in d.vllm_models for a in x.adapters) or 'none'})")
    try:
        unload_everywhere(_engines(d, m), name)
    except RuntimeLoraError as exc:
        raise DeploymentError(str(exc)) from None
    _edit(deployment, lambda data: _entry(data, m.name)["adapters"].pop(name))
    return m


def _entry(data, model: str):
    return next(entry for entry in data["models"] if entry.get("name") == model)


def _edit(path: Path, change) -> None:
    """Apply `change` to the deployment file's data and write it back with its comments and order, atomically (a
    temporary file renamed over it: `serve up` never reads half a file)."""
    from ruamel.yaml import YAML

    path = Path(path)
    yaml = YAML()  # round trip
    yaml.preserve_quotes = True
    data = yaml.load(path.read_text())
    change(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        yaml.dump(data, f)
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)

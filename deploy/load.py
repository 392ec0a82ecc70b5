"""Reading a deployment file (deploy/spec.py's schema) and checking the artifacts it names.

`load_deployment` checks every field on load, each error naming the field it is about (`models[1].replicas: ...`).
`check_artifacts` then checks that each artifact exists and is of the kind the file says: that needs the files, so a
deployment can be rendered for another machine without them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from pydantic import ValidationError

from core.entry_metadata import FILE as ENTRY_METADATA, EntryMetadata, EntryMetadataError
from core.tasks import KINDS, LLM, SPEECH, TASKS

from .spec import Deployment, DeploymentError, EncoderModel

log = logging.getLogger("rtxserve.deploy")


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in KINDS or str(part).startswith("function-"):
            continue  # pydantic's union / validator tags
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_deployment(data: dict, base_dir: Path = Path(".")) -> Deployment:
    """A Deployment from parsed YAML; DeploymentError names each field that is wrong."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise DeploymentError("a deployment file is a YAML mapping (name:, gpus:, models:, ...)")
    for internal in ("base_dir", "file"):
        if internal in data:
            raise DeploymentError(f"{internal}: not a field of the deployment file")
    try:
        deployment = Deployment.model_validate({**data, "base_dir": Path(base_dir).resolve()})
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            message = e["msg"].removeprefix("Value error, ")
            where = _where(e["loc"])  # a check across fields names its fields in the message
            lines.append(f"{where}: {message}" if where else message)
        raise DeploymentError("invalid deployment:\n  " + "\n  ".join(lines)) from None
    return deployment


def load_deployment(path: Path) -> Deployment:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise DeploymentError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise DeploymentError(f"{path} is not valid YAML: {exc}") from None
    deployment = parse_deployment(data, path.parent)
    deployment.file = path.resolve()
    return deployment


def encoder_metadata(d: Deployment, m: EncoderModel) -> EntryMetadata:
    """The entry's rtxserve.json (what export wrote), after checking that the artifact is an exported entry."""
    path = d.resolve(m.path)
    if not (path / "config.pbtxt").is_file():
        hint = " (an LLM folder: use kind: llm)" if (path / "config.json").is_file() else ""
        raise DeploymentError(f"models.{m.name}: {path} is not a Triton entry exported by `rtxserve export onnx` "
                              f"(no config.pbtxt){hint}")
    if path.name != m.name:
        raise DeploymentError(f"models.{m.name}: the entry at {path} is named {path.name!r}; Triton serves an entry by "
                              f"its folder name, so use name: {path.name} (or export it again with --name {m.name})")
    meta_path = path / ENTRY_METADATA
    if not meta_path.is_file():
        raise DeploymentError(f"models.{m.name}: {meta_path} is missing: not an entry written by `rtxserve export onnx`")
    try:
        meta = EntryMetadata.read(meta_path)
    except EntryMetadataError as exc:
        raise DeploymentError(f"models.{m.name}: {exc}") from None
    for note in meta.assumed:
        log.warning("models.%s: %s (export it again to record it under its own name)", m.name, note)
    kind = TASKS[meta.task].kind if meta.task in TASKS else None
    if kind != m.kind:
        raise DeploymentError(f"models.{m.name}: {path} holds a {meta.task} entry; use kind: {kind}")
    target = "gpu" if d.on_gpu else "cpu"
    if meta.target != target:
        raise DeploymentError(f"models.{m.name}: {path} was exported for {meta.target} but this deployment runs "
                              f"on {target}; export it again with --target {target}")
    from serve.entry_config import entry_models

    try:
        steps = entry_models(path.parent, m.name)[1:]
    except ValueError as exc:  # a config.pbtxt Triton's schema cannot read
        raise DeploymentError(f"models.{m.name}: {exc}") from None
    for step in steps:
        if not (step / "config.pbtxt").is_file():
            raise DeploymentError(f"models.{m.name}: its step {step.name} is missing beside it in {path.parent}")
    return meta


def check_artifacts(d: Deployment) -> None:
    """Every artifact exists and is of the kind the file says (DeploymentError naming the first that is not)."""
    for m in d.encoders:
        encoder_metadata(d, m)
    from serve.vllm_server import is_speech_model

    for m in d.vllm_models:
        path = d.resolve(m.path)
        if not (path / "config.json").is_file():
            hint = " (a Triton entry: use kind: encoder)" if (path / "config.pbtxt").is_file() else ""
            raise DeploymentError(f"models.{m.name}: {path} is not a Hugging Face model folder (no config.json){hint}")
        if is_speech_model(path) != (m.kind == SPEECH):
            found, kind = ("a speech model (Whisper)", SPEECH) if m.kind == LLM else ("not a speech model (Whisper)", LLM)
            raise DeploymentError(f"models.{m.name}: {path} is {found}; use kind: {kind}")
        for name, adapter in m.adapters.items():
            if not (d.resolve(adapter) / "adapter_config.json").is_file():
                raise DeploymentError(f"models.{m.name}.adapters.{name}: {d.resolve(adapter)} is not a PEFT adapter "
                                      "folder (no adapter_config.json)")
    if d.gateway.keys_file is not None and not d.resolve(d.gateway.keys_file).is_file():
        raise DeploymentError(f"gateway.keys_file: {d.resolve(d.gateway.keys_file)} does not exist")
    if d.store.password_file is not None and not d.resolve(d.store.password_file).is_file():
        raise DeploymentError(f"store.password_file: {d.resolve(d.store.password_file)} does not exist")

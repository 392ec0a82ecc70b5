"""The folder a served LLM or Whisper is packaged as, made the same way by every export that makes one (the full, LoRA,
merged and converted packages, quantize.py, speech/whisper.py): its weights checked, its files hard-linked in, its
chat template and rtxserve.json (what it is, from what, how made) written, all in a work folder beside the output and
renamed into place at the end, so that a failure leaves nothing half-written."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.weights import WeightsIndexError, safetensors_files

from ..checkpoint import TOKENIZER_FILES, check_safetensors
from ..exceptions import ExportError
from ..triton import repository

log = logging.getLogger(__name__)

TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                        "added_tokens.json", "merges.txt", "generation_config.json", *("processor_config.json",
                        "preprocessor_config.json", "video_preprocessor_config.json"))


@dataclass
class LLMExport:
    """What an LLM export made: the package folder, its rtxserve.json, the command that serves it, the wall time."""

    kind: str  # "full", "lora", "merged" or "quantized"
    out: Path
    metadata: dict
    serve_command: str
    seconds: float


def weight_files(path: Path) -> tuple[Path, ...]:
    """Every weight file of a checkpoint (shards included), each checked for truncation."""
    try:
        files = tuple(safetensors_files(path))
    except WeightsIndexError as exc:
        raise ExportError(str(exc)) from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ExportError(f"{path / 'model.safetensors.index.json'} lists shards that are missing: {', '.join(missing)}")
    if not files and ((path / "pytorch_model.bin").is_file() or (path / "pytorch_model.bin.index.json").is_file()):
        raise ExportError(f"{path} holds pickled pytorch_model.bin weights; save them as safetensors "
                          "(model.save_pretrained(out, safe_serialization=True)): vLLM and rtxserve load only safetensors")
    if not files:
        raise ExportError(f"no model weights in {path}: expected model.safetensors or model.safetensors.index.json")
    for file in files:
        check_safetensors(file)
    return files


@contextlib.contextmanager
def package_folder(out: Path) -> Iterator[Path]:
    """A folder to build the package in, on `out`'s file system, renamed to `out` on success only."""
    with repository.work_dir(out) as work:
        pkg = work / "pkg"
        pkg.mkdir()
        yield pkg
        if out.exists():
            os.replace(out, work / "retired")
        os.replace(pkg, out)


def copy_files(files: list[Path], dest: Path) -> None:
    """Hard-link where possible (same file system, instant for 16 GB of shards), else copy; log sizes. A linked file
    is the source's own: what replaces one in the package unlinks it first (add_chat_template), never writes into it."""
    for file in files:
        target = dest / file.name
        try:
            os.link(file, target)
        except OSError:
            shutil.copy2(file, target)
        log.info("    %s (%.1f MB)", file.name, file.stat().st_size / 1e6)


def side_files(path: Path) -> list[Path]:
    """The tokenizer, chat template, generation and processor files beside a model or adapter in `path`."""
    return [path / n for n in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES) if (path / n).is_file()]


def _versions() -> dict:
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import peft

        versions["peft"] = peft.__version__
    except ImportError:
        pass
    return versions


def write_metadata(pkg: Path, metadata: dict) -> None:
    """The package's rtxserve.json: `metadata`, when it was made and the versions that made it."""
    metadata = {**metadata, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": _versions()}
    (pkg / "rtxserve.json").write_text(json.dumps(metadata, indent=2) + "\n")


def add_chat_template(pkg: Path, chat_template: Path | None) -> None:
    """Ship the Jinja file `chat_template` (if any) as the package's chat_template.jinja."""
    if chat_template is not None:
        try:
            text = Path(chat_template).read_text()
        except OSError as exc:
            raise ExportError(f"cannot read the chat template {chat_template}: {exc}") from exc
        target = pkg / "chat_template.jinja"
        target.unlink(missing_ok=True)  # may be a hard link to the checkpoint's own template (copy_files): never write into it
        target.write_text(text)

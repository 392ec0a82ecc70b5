"""Read and change how one served Triton entry batches and how many instances it runs, in its config.pbtxt
files, through Triton's own ModelConfig schema (what `rtxserve tune` searches and `--apply` writes back).

An entry is an ensemble and the models its steps name. The knobs map to export's flags: `max_batch_size`
on the ensemble and every step (Triton refuses an ensemble that allows bigger batches than a step);
`instances` and `max_queue_delay_us` on the steps that batch dynamically (tokenizer / preprocess and model).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from core.contract import MAX_BATCH_SIZE


@dataclass(frozen=True)
class Batching:
    instances: int
    max_batch_size: int
    max_queue_delay_us: int

    def __post_init__(self) -> None:
        # max_batch_size 0: a model that takes whole requests, unbatched (a diffusion pipeline)
        if self.instances < 1 or not 0 <= self.max_batch_size <= MAX_BATCH_SIZE or self.max_queue_delay_us < 0:
            raise ValueError(f"instances >= 1, max_batch_size in 0..{MAX_BATCH_SIZE} and max_queue_delay_us >= 0, not {self}")


def read_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        raise ValueError(f"{path}: not a readable Triton config ({exc})") from None


def write_config(path: Path, config) -> None:
    from google.protobuf import text_format

    # A new file renamed over the old one: atomic, and never written through a hard link into another repository.
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text_format.MessageToString(config))
    os.replace(temporary, path)


def entry_models(repository: Path, name: str) -> list[Path]:
    """The entry's model folders: the ensemble first, then each step it names."""
    config_path = repository / name / "config.pbtxt"
    if not config_path.is_file():
        served = sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
        raise ValueError(f"no entry {name!r} in {repository}; entries: {', '.join(served) or 'none'}")
    config = read_config(config_path)
    if config.platform != "ensemble":
        return [repository / name]
    steps = list(dict.fromkeys(step.model_name for step in config.ensemble_scheduling.step))
    return [repository / name, *(repository / s for s in steps)]


def read_batching(repository: Path, name: str) -> Batching:
    """The entry's knobs as they are now (from its dynamically batched steps)."""
    configs = [read_config(m / "config.pbtxt") for m in entry_models(repository, name)]
    batched = [c for c in configs if c.HasField("dynamic_batching")] or configs
    return Batching(instances=max((g.count for c in batched for g in c.instance_group), default=1),
                    max_batch_size=configs[0].max_batch_size,
                    max_queue_delay_us=max(c.dynamic_batching.max_queue_delay_microseconds for c in batched))


def write_batching(repository: Path, name: str, batching: Batching) -> None:
    """Set the entry's knobs in place (a single-model entry without dynamic batching, as a diffusion pipeline,
    takes its instance count and keeps its max_batch_size)."""
    folders = entry_models(repository, name)
    configs = {folder / "config.pbtxt": read_config(folder / "config.pbtxt") for folder in folders}
    if len(folders) > 1 and not any(c.HasField("dynamic_batching") for c in configs.values()):
        raise ValueError(f"entry {name!r} in {repository}: none of its steps is dynamically batched, so it has no "
                         "instance count to set; export it again with rtxserve export")
    for path, config in configs.items():
        if len(folders) == 1 and not config.HasField("dynamic_batching"):
            for group in config.instance_group:
                group.count = batching.instances
            write_config(path, config)
            continue
        config.max_batch_size = batching.max_batch_size
        if config.HasField("dynamic_batching"):
            config.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
            for group in config.instance_group:
                group.count = batching.instances
        write_config(path, config)


def link_file(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def copy_entry(repository: Path, name: str, to: Path) -> Path:
    """A repository holding only `name`'s models, with hard links for the files (weights are not copied)."""
    to.mkdir(parents=True, exist_ok=True)
    for folder in entry_models(repository, name):
        if (to / folder.name).exists():  # a copy left by an earlier run: made again from the source
            shutil.rmtree(to / folder.name)
        shutil.copytree(folder, to / folder.name, copy_function=link_file)
    return to

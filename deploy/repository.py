"""The Triton repository a deployment serves: each entry linked from where export wrote it, configured as planned."""

from __future__ import annotations

import shutil
from pathlib import Path

from serve.entry_config import (Batching, copy_entry, entry_models, read_batching, read_config, write_batching,
                                write_config)


def assemble_repository(d, p, to: Path) -> Path:
    """The repository Triton serves for a deployment `d` (deploy.spec) planned as `p` (deploy.plan): each entry
    hard-linked from where export wrote it, with the planned instance count (and max batch size, when the
    deployment sets one) on every GPU Triton sees, as the plan places them. GPU ids pinned at export (`--gpus`)
    are dropped: they name the export machine's cards, and a Kubernetes pod sees its one GPU as 0."""
    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    for m in d.encoders:
        source = d.resolve(m.path)
        copy_entry(source.parent, m.name, to)
        batching = read_batching(to, m.name)
        write_batching(to, m.name, Batching(instances=p.instances[m.name],
                                                  max_batch_size=m.max_batch_size or batching.max_batch_size,
                                                  max_queue_delay_us=batching.max_queue_delay_us))
        for folder in entry_models(to, m.name):
            config = read_config(folder / "config.pbtxt")
            if any(group.gpus for group in config.instance_group):
                for group in config.instance_group:
                    del group.gpus[:]
                write_config(folder / "config.pbtxt", config)
    return to

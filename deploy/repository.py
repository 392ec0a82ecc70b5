"""The Triton repository a deployment serves: each entry linked from where export wrote it, configured as planned."""

from __future__ import annotations

import shutil
from pathlib import Path

from serve.entry_config import (Batching, copy_entry, entry_models, read_batching, read_config, write_batching,
                                write_config)


def assemble_repository(d, p, to: Path) -> Path:
    """The repository Triton serves for a deployment `d` (deploy.spec) planned as `p` (deploy.plan): each entry
    hard-linked from where export wrote it, with the planned instance count (and max batch size, when the
    deployment sets one) on every GPU Triton sees, as the plan places them, and Triton's response cache where the
    deployment asks for it (triton_response_cache). GPU ids pinned at export (`--gpus`) are dropped: they name the
    export machine's cards, and a Kubernetes pod sees its one GPU as 0."""
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
        for folder in entry_models(to, m.name):  # the entry's own model first: the one clients call
            config = read_config(folder / "config.pbtxt")
            pinned = any(group.gpus for group in config.instance_group)
            for group in config.instance_group:
                del group.gpus[:]
            cached = folder.name == m.name and m.triton_response_cache
            if cached:  # the whole request's answer, looked up before any step runs
                config.response_cache.enable = True
            if pinned or cached:
                write_config(folder / "config.pbtxt", config)
    return to


def response_cache_args(d) -> list[str]:
    """tritonserver's --cache-config for the entries with Triton's response cache: one local cache of their sizes'
    sum."""
    mb = sum(m.response_cache_mb for m in d.encoders if m.triton_response_cache)
    return [f"--cache-config=local,size={mb * 2**20}"] if mb else []

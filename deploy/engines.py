"""TensorRT plans built on the box that serves them (`tensorrt: true` on an encoder of a GPU deployment).

A plan loads only in the TensorRT that built it, on the GPU architecture it was built for. So instead of
shipping plans, the rendered deployment ships the entry's ONNX graph and builds the plan on the box, with
`trtexec` in NVIDIA's TensorRT container of the same release as the Triton image that serves it (NGC
pairs the two by YY.MM: deploy/images.py): a compose service that the Triton service waits for, and an
init container of the Triton pod in Kubernetes. The optimisation profile is the one `rtxserve export
--tensorrt` uses by default (export/tensorrt/plan.py: batch 1..B, sequence 1..L), and a plan already built is
kept.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from core.entry_metadata import EntryMetadata

from .spec import Deployment, DeploymentError


@dataclass(frozen=True)
class Build:
    model: str  # the entry's `<name>_model` folder
    shapes: dict[str, tuple[str, str, str]]  # input -> (min, opt, max) as trtexec takes them ("1x128")
    fp16: bool

    def command(self, repository: str) -> list[str]:
        folder = f"{repository}/{self.model}/1"
        argv = ["trtexec", f"--onnx={folder}/model.onnx", f"--saveEngine={folder}/model.plan"]
        for flag, i in (("--minShapes", 0), ("--optShapes", 1), ("--maxShapes", 2)):
            argv.append(f"{flag}=" + ",".join(f"{name}:{s[i]}" for name, s in self.shapes.items()))
        return argv + (["--fp16"] if self.fp16 else [])


def plan_tensorrt(d: Deployment, repository: Path) -> list[Build]:
    """For each `tensorrt: true` encoder in the assembled `repository`: turn its ONNX model step into a
    tensorrt_plan step (the graph stays beside it, for the build) and return what to build."""
    from export.tensorrt.plan import Profile
    from serve.entry_config import read_config, write_config

    builds = []
    for m in d.encoders:
        if not m.tensorrt:
            continue
        if not d.on_gpu:
            raise DeploymentError(f"models.{m.name}.tensorrt: TensorRT plans run on GPUs; this deployment has none")
        folder = repository / f"{m.name}_model"
        config = read_config(folder / "config.pbtxt")
        if config.platform != "onnxruntime_onnx" or not (folder / "1" / "model.onnx").is_file():
            raise DeploymentError(f"models.{m.name}.tensorrt: its model step is {config.platform or config.backend}, not an "
                                  "ONNX graph on onnxruntime_onnx: export it with --target gpu (without --tensorrt: the "
                                  "plan is built on the box)")
        meta = EntryMetadata.read(repository / m.name)
        token_inputs = [i for i in config.input if list(i.dims) == [-1]]
        fixed = {i.name: tuple(i.dims) for i in config.input if list(i.dims) != [-1]}
        profile = Profile.parse(max_batch_size=config.max_batch_size,
                                max_length=meta.max_length if token_inputs else None)
        shapes = profile.shapes({**{i.name: None for i in token_inputs}, **fixed})
        builds.append(Build(folder.name, {n: tuple("x".join(map(str, s)) for s in mmo) for n, mmo in shapes.items()},
                            fp16=meta.precision == "fp16"))
        config.platform = "tensorrt_plan"
        config.default_model_filename = "model.plan"
        write_config(folder / "config.pbtxt", config)
    return builds


def build_script(builds: list[Build], repository: str) -> str:
    """A POSIX shell script that builds each plan that is not there yet."""
    lines = ["#!/bin/sh", "# Build the TensorRT plans of this deployment on this box's GPU (rtxserve deploy render).", "set -eu"]
    for b in builds:
        plan = f"{repository}/{b.model}/1/model.plan"
        lines += [f'if [ -s {plan} ]; then echo "{b.model}: plan already built"; else',
                  f'  echo "{b.model}: building its TensorRT plan"', f"  {shlex.join(b.command(repository))}", "fi"]
    return "\n".join(lines) + "\n"

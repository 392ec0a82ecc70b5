"""A box named on the command line (`rtxserve eval BOX ...`, `rtxserve promote BOX ...`): its gateway's URL, and where
each of its models' artifacts (and so their reference sets) lie.

BOX is the gateway's URL (http://host:port: a box anywhere; the artifacts are then named with --reference), or a box
`serve up` started: its deployment file, its name, or its run folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .box_state import read_state, run_dir
from .spec import Deployment, DeploymentError, EncoderModel, LLMModel
from .load import load_deployment


@dataclass(frozen=True)
class BoxTarget:
    url: str  # the gateway's base URL
    deployment: Deployment | None = None  # None: a box given by URL
    run: Path | None = None

    def artifact(self, model: str) -> Path | None:
        """The folder `model` was exported to (a Triton entry, an LLM or adapter package), as the deployment file names
        it; None for a box given by URL, or a model the file does not name (an adapter added at run time)."""
        if self.deployment is None:
            return None
        for m in self.deployment.models:
            if m.name == model:
                return self.deployment.resolve(m.path)
            if isinstance(m, LLMModel) and model in m.adapters:
                return self.deployment.resolve(m.adapters[model])
        return None

    def served_by_triton(self, model: str) -> bool:
        return self.deployment is not None and any(isinstance(m, EncoderModel) and m.name == model
                                                   for m in self.deployment.models)


def resolve_box(box: str, state_root: Path | None = None) -> BoxTarget:
    """The box `box` names; DeploymentError saying what was looked for."""
    if urlsplit(box).scheme in ("http", "https"):
        return BoxTarget(box.rstrip("/"))
    path = Path(box)
    if path.is_file():
        deployment = load_deployment(path)
        run = run_dir(deployment.name, state_root)
    else:
        run = path if (path / "state.json").is_file() else run_dir(box, state_root)
        state = read_state(run)  # DeploymentError: nothing runs from there
        if not state.get("file"):
            raise DeploymentError(f"{run / 'state.json'} names no deployment file (started before `serve up` recorded "
                                  "it): give the deployment file as BOX")
        deployment = load_deployment(Path(state["file"]))
    return BoxTarget(gateway_url(run), deployment, run)


def gateway_url(run: Path) -> str:
    """The base URL of the gateway a `serve up` run started (from its readiness URL in state.json)."""
    for server in read_state(run)["servers"]:
        if server.get("kind") == "gateway":
            parts = urlsplit(server["url"])
            return f"{parts.scheme}://{parts.netloc}"
    raise DeploymentError(f"{run / 'state.json'} lists no gateway: is the box up? (`rtxserve serve status`)")

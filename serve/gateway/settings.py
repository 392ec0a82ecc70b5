"""Gateway deployment settings: one object, from env (RTXSERVE_*) and an optional YAML file."""

from __future__ import annotations

import functools
import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource)

from core import contract


def read_password(path: Path) -> str:
    """A password file's first line (a mounted secret, a systemd credential); ValueError naming the file where it
    cannot be read or is empty."""
    try:
        return path.read_text().splitlines()[0]
    except (OSError, IndexError) as exc:
        raise ValueError(f"{path}: cannot read a password ({exc if isinstance(exc, OSError) else 'the file is empty'})"
                         ) from None


class Alias(BaseModel):
    """A model name that sends each request to one of its targets, by weight (a canary: 90 / 10)."""

    model_config = ConfigDict(extra="forbid")

    targets: dict[str, int] = Field(description="model -> its share of the alias's requests, in percent (sum 100)")
    sticky: Literal["none", "key", "user"] = Field("none", description="key / user: the same API key, or the same "
                                                   "request `user`, always gets the same target")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"targets": data} if isinstance(data, dict) and "targets" not in data else data

    @field_validator("targets")
    @classmethod
    def _weights(cls, targets: dict[str, int]) -> dict[str, int]:
        if not targets or any(w < 0 for w in targets.values()) or sum(targets.values()) != 100:
            raise ValueError(f"weights {targets} must be whole percents that sum to 100")
        return targets


class OnDemand(BaseModel):
    """A model loaded when a request first asks for it and unloaded when idle or when another needs its room
    (residency.py). `rtxserve deploy` writes these from the deployment file's `resident: on-demand` models."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(description="its task (core.tasks), known before it is loaded: /v1/models lists it meanwhile")
    gib: float = Field(gt=0, description="the memory it takes once loaded, GiB, as `rtxserve plan` estimates it")
    idle_unload_s: float | None = Field(None, gt=0, description="unloaded after this many seconds without a request; "
                                        "none: only when another on-demand model needs its room")
    engine: str = Field("", description="a vLLM model: the engine serving it (one of vllm_url), woken and put to "
                        "sleep through engine_control; empty: a Triton entry")
    adapters: list[str] = Field(default_factory=list, description="a vLLM model: its LoRA adapters, which wake and "
                                "sleep with it")


class GatewaySettings(BaseSettings):
    """Everything the gateway process reads at start. Env: RTXSERVE_<FIELD>; file: RTXSERVE_CONFIG (YAML)."""

    model_config = SettingsConfigDict(env_prefix="RTXSERVE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(contract.GATEWAY_PORT, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=64)
    triton_grpc_url: str = Field(f"127.0.0.1:{contract.TRITON_GRPC_PORT}", description="Triton gRPC address, or several (replicas) "
                                 "separated by commas; empty: no Triton")
    vllm_url: str = Field("", description="vLLM OpenAI server base URL, e.g. http://127.0.0.1:8100, or several (one "
                          "engine per GPU) separated by commas; empty: no vLLM")
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open a replica's circuit breaker")
    breaker_reset_s: float = Field(10.0, gt=0, description="how long an open breaker keeps traffic away")
    keys_file: Path | None = Field(None, description="API keys file (`rtxserve keys create`); none: no auth, "
                                   "allowed only when the gateway binds to loopback")
    otlp_endpoint: str = Field("", description="OpenTelemetry OTLP/HTTP traces endpoint, e.g. "
                               "http://127.0.0.1:4318/v1/traces; empty: no tracing (needs the otel extra)")
    rate_limit_storage: str = Field("", description="where per-key quotas are counted, a `limits` storage URI: "
                                    "async+sqlite:///FILE shared by one box's workers (what `serve gateway` sets up with "
                                    "several workers), async+redis://HOST:PORT for a fleet; empty: this process's memory")
    rate_limit_unavailable: Literal["open", "closed"] = Field(
        "open", description="while the quota storage cannot be reached (Redis restarting): open admits requests "
        "uncounted (with a warning and a metric), closed refuses them with 503")
    coalesce_calls: int = Field(1, ge=0, le=64, description="Triton calls in flight per model and worker for classify, "
                                "embeddings and NER; the requests that arrive while they are out wait and leave "
                                "together as one call, up to the model's max_batch_size (benchmark B1). Raise it "
                                "towards the model's instance count where its instances should run side by side "
                                "(a GPU with room to spare); 0: each request its own call, at once")
    request_timeout_s: float = Field(30.0, gt=0, le=3600, description="deadline for one Triton call")
    generation_timeout_s: float = Field(600.0, gt=0, le=24 * 3600,
                                        description="deadline for one vLLM answer, or between two chunks of a stream")
    drain_s: float = Field(5.0, ge=0, le=600, description="after SIGTERM: seconds not-ready but still serving, "
                           "so that load balancers stop sending before the gateway stops accepting")
    max_concurrency: int = Field(256, ge=1, description="model requests in flight per worker; more wait in the queue")
    max_queue: int = Field(512, ge=0, description="model requests waiting per worker; more are refused at once (503)")
    model_concurrency: dict[str, int] = Field(
        default_factory=dict, description='model -> its requests in flight per worker (streams count until they end), '
        'e.g. {"llm": 32}; more wait in a queue of max_queue. Models not named share only max_concurrency')
    response_cache_mb: dict[str, Annotated[float, Field(ge=0, le=65536)]] = Field(
        default_factory=dict, description='model -> MB of its classify, embeddings and NER answers the gateway keeps '
        'per worker, e.g. {"reviews": 64}: an input seen before is answered without a backend call (fleet/answer_cache.py); '
        "models not named: none kept")
    queue_timeout_s: float = Field(10.0, gt=0, description="longest wait for a slot before 503")
    health_interval_s: float = Field(2.0, gt=0, le=300, description="how often backends are polled for readiness")
    aliases: dict[str, Alias] = Field(
        default_factory=dict, description='model names that split their requests between models by weight, e.g. '
        '{"reviews": {"reviews-v1": 90, "reviews-v2": 10}}, or {"reviews": {"targets": {...}, "sticky": "key"}}; '
        'the answer names the model that answered; the alias requests metric counts them by model')
    fallbacks: dict[str, list[str]] = Field(
        default_factory=dict, description='model -> models tried in order when it has no live replica (every replica '
        'down or its breaker open), e.g. {"llm-big": ["llm-small"]}; never once a stream has begun, never for a '
        "client's error")
    affinity: bool = Field(True, description="cache-aware routing of generation requests to a model several replicas "
                           "serve: each replica scored by how much of the request's prefix it was recently sent "
                           "(prefix.py: its conversation, and its prompt's blocks of prefix_block_chars) against its "
                           "share of the tokens in flight, with affinity_load_factor as a cap and least busy where no "
                           "replica holds any of it (B10: later turns' TTFT well under least busy's once the engines' "
                           "caches run out, the same while they hold everything). Off: least busy")
    affinity_load_factor: float = Field(1.25, ge=1.0, le=10.0, description="the most a replica takes of a model's "
                                        "requests in flight, as a multiple of the average, before a request that "
                                        "prefers it for its prefix goes to another (bounded load)")
    affinity_load_weight: float = Field(0.5, ge=0.0, le=100.0, description="how much a replica's share of the tokens "
                                        "in flight counts against the share of the prefix it holds (both 0 to 1)")
    vllm_priority: bool = Field(False, description="the vLLM engines run with --scheduling-policy priority: each "
                                "generation request carries its key's priority (a client may ask for a later place, "
                                "never an earlier one than its key's)")
    prefix_block_chars: int = Field(64, ge=8, le=65536, description="characters per block of a prompt's prefix hashes "
                                    "(about 16 tokens, vLLM's block)")
    prefix_index_blocks: int = Field(50_000, ge=100, description="block hashes remembered per replica (LRU)")
    on_demand: dict[str, OnDemand] = Field(
        default_factory=dict, description='models loaded on their first request and unloaded when idle or to make '
        'room, e.g. {"reviews-de": {"task": "text-classification", "gib": 0.6, "idle_unload_s": 600}}; the others '
        'are loaded when their server starts and stay (Triton runs in explicit model-control mode for these)')
    swap_room_gib: float = Field(0.0, ge=0, description="the memory the on-demand models share, GiB (the plan's swap "
                                 "room): the least recently used idle one is unloaded when a load would pass it")
    load_wait_s: float = Field(30.0, gt=0, le=3600, description="how long a request waits for its model to load; "
                               "then 503 with Retry-After, while the load goes on")
    engine_control: dict[str, str] = Field(
        default_factory=dict, description="on-demand vLLM engines: engine URL -> where its sleep API answers (the "
        "engine itself on a GPU, started with --enable-sleep-mode; serve/engine_control.py's server on a CPU)")
    sleep_level: Literal[1, 2] = Field(1, description="how an on-demand vLLM engine on a GPU sleeps: 1 moves its "
                                       "weights to host memory (a fast wake), 2 drops them (for a host short of memory)")
    residency_store_url: str = Field("", description="where several gateways serving on-demand models (a box's "
                                     "workers, a fleet's pods) agree on what is loaded, one of them deciding for all "
                                     "(fleet/decider.py): sqlite:///FILE for one box's workers (what `serve gateway` "
                                     "sets up with several workers), PostgreSQL for a fleet whose gateways share their "
                                     "backends (its password: batch_store_password_file); empty: this gateway decides "
                                     "alone. Never a database that gateways with backends of their own share: each "
                                     "decider loads on its own backends only")
    residency_lease_s: float = Field(5.0, ge=1, le=600, description="a residency decider (a gateway) that has not "
                                     "renewed its lease for this long is replaced by another; a gateway whose beat is "
                                     "this old is taken for dead (its requests no longer hold a model loaded)")
    load_timeout_s: float = Field(600.0, gt=0, le=3600, description="the longest one load of an on-demand model may "
                                  "take before it counts as failed")
    load_retry_s: float = Field(5.0, gt=0, le=3600, description="after a failed load, requests are refused (503) "
                                "this long before the next try, doubled after each failure up to 60 s")
    batch_dir: Path | None = Field(None, description="where the Files and Batch APIs (/v1/files, /v1/batches) keep "
                                   "uploads, outputs and their state (SQLite): a directory the gateway owns, kept "
                                   "across restarts; none: those APIs answer 404")
    batch_store_url: str = Field("", description="the Files and Batch APIs' store shared by several gateways (a "
                                 "box's workers, a fleet's pods): a PostgreSQL URL (postgresql+psycopg://USER:PASSWORD@"
                                 "HOST/DB), which then keeps the files' bytes too; empty: SQLite under batch_dir")
    batch_store_password_file: Path | None = Field(None, description="a file holding the password of batch_store_url's "
                                                   "user (a mounted secret: compose's, Kubernetes', systemd's "
                                                   "credential), so that the URL itself holds none")
    batch_lease_s: float = Field(30.0, ge=2, le=3600, description="a batch whose runner (a gateway worker) has not "
                                 "renewed its lease for this long is taken over by another runner")
    batch_max_file_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="bytes per uploaded file (413 over it; "
                                      "max_body_bytes bounds every request too)")
    batch_max_requests: int = Field(50_000, ge=1, description="requests per batch input file (OpenAI's limit)")
    batch_files_expire_s: int = Field(30 * 24 * 3600, ge=0, description="a file of the Files API (an upload, a "
                                      "batch's output) is deleted this long after it was made, unless its "
                                      "`expires_after` says otherwise (OpenAI's default for batch files: 30 days); "
                                      "0: kept until deleted")
    batch_parallel: int = Field(4, ge=1, le=64, description="batches run side by side at most (oldest first; the "
                                "others wait, validating): one key's long batch does not hold back another's")
    batch_concurrency: int = Field(8, ge=1, le=1024, description="a batch's requests in flight at once; they wait "
                                   "behind interactive requests at the gateway's gates (and in vLLM with "
                                   "vllm_priority), at batch priority")
    batch_yields: bool = Field(True, description="a batch's requests (priority batch or later) wait at the gateway "
                               "while people's requests to the same servers wait for their first token (yielding.py); "
                               "off: only the model gates and vLLM's queue order them")
    batch_floor: int = Field(1, ge=1, le=1024, description="a batch's requests per server group that go even while "
                             "people wait: its floor share (it never starves)")
    promotions: bool = Field(True, description="whether `rtxserve promote` may run on this gateway (its admin "
                             "routes): off where its workers or pods cannot share one rollout_file (Kubernetes' "
                             "gateway pods, each with its own)")
    rollout_file: Path | None = Field(None, description="where promotions (`rtxserve promote`) keep the routes they "
                                      "changed, the models they retired and their own state, so that every worker and "
                                      "the next start see them: a file on the gateway's own volume; none: this "
                                      "process's memory (a restart serves the settings' routes again)")
    capacity_file: Path | None = Field(None, description="where each model's last confirmed capacity is kept "
                                       "(`rtxserve capacity --record` sends it here), with the box it was measured on: "
                                       "/metrics says the share of it today's traffic uses "
                                       "(fleet/headroom.py); none: this process's memory")
    restarts_file: Path | None = Field(None, description="where the keeper of a `serve up` box counts the servers it "
                                       "started again (deploy/keeper.py): /metrics reports them; none: "
                                       "not reported")
    trace_dir: Path | None = Field(None, description="where each gateway worker writes its traffic trace "
                                   "(trace-PID.jsonl: one line per model request, sizes and times, never text; "
                                   "`rtxserve loadtest replay` sends it again); none: no trace")
    trace_max_bytes: int = Field(100 * 1024 * 1024, ge=4096, description="a trace file's size before it is rotated")
    trace_backups: int = Field(5, ge=0, le=1000, description="rotated trace files kept per worker")
    required_models: list[str] = Field(
        default_factory=list, description="models /readyz waits for (default: every model the backends serve)"
    )
    max_inputs: int = Field(256, ge=1, le=65536, description="texts per classify request")
    max_input_chars: int = Field(32768, ge=1, description="characters per text (the tokenizer truncates to tokens)")
    max_documents: int = Field(1000, ge=1, description="documents per rerank request, texts a side per score request "
                                "(Cohere's limit)")
    max_image_bytes: int = Field(16 * 1024 * 1024, ge=1, description="encoded bytes per image (after base64 decoding), "
                                 "of classify inputs and of chat image parts")
    # Bounds on generation parameters, checked before vLLM sees a request.
    max_tokens: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_n: int = Field(4, ge=1, le=128)
    max_stop: int = Field(4, ge=0, le=64, description="stop sequences per request (OpenAI allows 4)")
    max_messages: int = Field(256, ge=1)
    max_logprobs: int = Field(20, ge=0, description="logprobs / top_logprobs per token (vLLM's default cap)")
    max_prompt_chars: int = Field(400_000, ge=1, description="prompt characters (or token ids) per generation request")
    max_tools: int = Field(128, ge=0, description="tool definitions per chat request (OpenAI allows 128)")
    max_tools_bytes: int = Field(256 * 1024, ge=0, description="JSON size of a request's tool definitions")
    max_chat_images: int = Field(8, ge=0, description="image parts per chat request (each within max_image_bytes)")
    chat_image_domains: list[str] = Field(
        default_factory=list, description='hosts whose http(s) image URLs chat requests may send, e.g. '
        '["images.example.com"] (exact host names); give vLLM the same list as --allowed-media-domains, since vLLM '
        'fetches them. Empty: images only inline, as base64 data URLs. Other schemes (file:, ...) are always refused')
    # Bounds on image generation, checked before Triton sees a request.
    max_images: int = Field(4, ge=1, le=16, description="images per generation request (n)")
    max_image_size: int = Field(1024, ge=8, le=8192, description="pixels a side of a generated image")
    max_image_steps: int = Field(100, ge=1, le=1000, description="denoising steps per generation request")
    max_image_pixels: int = Field(4 * 1024 * 1024, ge=64, le=16 * 1024 * 1024,
                                  description="pixels of all the images of one request (n x width x height)")
    max_image_prompt_chars: int = Field(4000, ge=1, description="characters of a prompt (and of its negative prompt) "
                                        "for image generation: the text encoder takes 77 tokens")
    image_timeout_s: float = Field(300.0, gt=0, le=3600, description="deadline for one image generation request")
    # The front door: refused before the body is read / the route runs.
    # Speech uploads: checked (decoded headers) before vLLM sees them.
    max_audio_bytes: int = Field(25 * 1024 * 1024, ge=1, description="bytes per uploaded audio file (OpenAI's limit)")
    max_audio_seconds: float = Field(1800.0, gt=0, description="decoded duration per uploaded audio file, seconds")
    audio_khz: tuple[float, float] = Field((8.0, 192.0), description="lowest and highest sample rate, kHz, of an "
                                           "uploaded audio file")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="request body cap (413)")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="request headers cap, names and values (431)")

    @model_validator(mode="after")
    def _routes_are_models(self):
        for name, alias in self.aliases.items():
            if name in alias.targets or any(t in self.aliases for t in alias.targets):
                raise ValueError(f"aliases.{name}: a target is an alias itself; name models")
        for name, chain in self.fallbacks.items():
            if not chain or name in chain or name in self.aliases or any(f in self.aliases for f in chain):
                raise ValueError(f"fallbacks.{name}: name one or more other models (not aliases), in order")
        return self

    @model_validator(mode="after")
    def _on_demand_fits(self):
        unknown = sorted({m.engine for m in self.on_demand.values() if m.engine} - set(self.engine_control))
        if unknown:
            raise ValueError(f"on_demand: engines {', '.join(unknown)} have no engine_control URL to wake them with")
        over = {n: m.gib for n, m in self.on_demand.items() if m.gib > self.swap_room_gib}
        if over:
            raise ValueError(f"on_demand: {', '.join(f'{n} ({g:g} GiB)' for n, g in over.items())} cannot fit in "
                             f"swap_room_gib {self.swap_room_gib:g}")
        return self

    @functools.cached_property
    def on_demand_owners(self) -> dict[str, str]:
        """Each on-demand model and adapter -> the on-demand model whose load brings it (itself, or the engine model
        an adapter rides on): worked out once, read on every request."""
        return {n: n for n in self.on_demand} | {a: n for n, m in self.on_demand.items() for a in m.adapters}

    def on_demand_owner(self, name: str) -> str | None:
        """The on-demand model whose load brings `name`; None if `name` is always resident."""
        return self.on_demand_owners.get(name)

    def route_names(self) -> set[str]:
        """Every model name the aliases and fallbacks refer to (checked against what the backends serve)."""
        return {t for a in self.aliases.values() for t in a.targets} | set(self.fallbacks) | {
            f for chain in self.fallbacks.values() for f in chain}

    @model_validator(mode="after")
    def _store_is_postgresql(self):
        if self.batch_store_url and not self.batch_store_url.startswith("postgresql"):
            raise ValueError(f"batch_store_url: {self.batch_store_url.split('://')[0]}:// is not PostgreSQL; give "
                             "postgresql+psycopg://USER@HOST:PORT/DB, or batch_dir for SQLite on this host")
        if self.batch_store_password_file and not (self.batch_store_url or
                                                   self.residency_store_url.startswith("postgresql")):
            raise ValueError("batch_store_password_file: set batch_store_url or a PostgreSQL residency_store_url too "
                             "(the server it is the password of)")
        return self

    def residency_store(self) -> tuple[str, str | None]:
        """The database the residency decider shares (URL and password), or ("", None): this gateway decides alone."""
        url = self.residency_store_url
        return url, self.batch_store_password() if url.startswith("postgresql") else None

    def batch_store_password(self) -> str | None:
        """The store's password from batch_store_password_file (its first line), or None."""
        if self.batch_store_password_file is None:
            return None
        try:
            return read_password(self.batch_store_password_file)
        except ValueError as exc:
            raise ValueError(f"batch_store_password_file {exc}") from None

    @model_validator(mode="after")
    def _no_open_door_off_loopback(self):
        if open_door(self.host, self.keys_file):
            raise ValueError(f"host {self.host} is not loopback and no keys_file is set: anyone who can reach it could "
                             "use every model. Make keys (`rtxserve keys create`) and set RTXSERVE_KEYS_FILE / --keys, "
                             "or bind 127.0.0.1")
        return self

    def urls(self, kind: str) -> list[str]:
        """The replicas of one backend kind ("triton" or "vllm")."""
        value = {"triton": self.triton_grpc_url, "vllm": self.vllm_url}[kind]
        return [u.strip() for u in value.split(",") if u.strip()]

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        path = os.environ.get("RTXSERVE_CONFIG")
        if path:
            if not os.path.isfile(path):
                raise ValueError(f"RTXSERVE_CONFIG={path} does not exist")
            sources += (YamlConfigSettingsSource(settings_cls, yaml_file=path),)
        return sources


def open_door(host: str, keys_file) -> bool:
    """The rule, for the gateway and the deployment file alike: without keys, the gateway binds loopback only."""
    return keys_file is None and not is_loopback(host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

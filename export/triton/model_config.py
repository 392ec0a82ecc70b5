"""Typed Triton model configurations, rendered to `config.pbtxt` through Triton's own schema.

The dataclasses validate in `__post_init__`; `to_pbtxt()` goes through the `ModelConfig` protobuf
that ships with `tritonclient`, so a misspelt field or enum fails here, not at server start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DATA_TYPES = frozenset(
    "TYPE_BOOL TYPE_UINT8 TYPE_UINT16 TYPE_UINT32 TYPE_UINT64 TYPE_INT8 TYPE_INT16 TYPE_INT32 "
    "TYPE_INT64 TYPE_FP16 TYPE_FP32 TYPE_FP64 TYPE_STRING TYPE_BF16".split()
)
INSTANCE_KINDS = frozenset({"KIND_CPU", "KIND_GPU", "KIND_AUTO", "KIND_MODEL"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def check_model_name(name: str) -> str:
    """Return `name` if Triton and file systems accept it as a model name, else raise ValueError."""
    if not _NAME.match(name) or len(name) > 128:
        raise ValueError(
            f"invalid model name {name!r}: use letters, digits, '_', '-' or '.', starting with a "
            "letter or digit (at most 128 characters)"
        )
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: dims exclude the batch dimension when max_batch_size > 0."""

    name: str
    data_type: str
    dims: tuple[int, ...]
    # Inputs only: the dynamic batcher may group requests whose shapes differ (the model pads them itself).
    allow_ragged_batch: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tensor name must not be empty")
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"tensor {self.name}: unknown data type {self.data_type!r}")
        if not self.dims or any(d == 0 or d < -1 for d in self.dims):
            raise ValueError(f"tensor {self.name}: dims must be positive or -1, got {self.dims}")

    def to_dict(self) -> dict:
        d = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        return d | ({"allow_ragged_batch": True} if self.allow_ragged_batch else {})


@dataclass(frozen=True)
class InstanceGroup:
    count: int = 1
    kind: str = "KIND_CPU"
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"instance count must be >= 1, got {self.count}")
        if self.kind not in INSTANCE_KINDS:
            raise ValueError(f"unknown instance kind {self.kind!r}; valid: {sorted(INSTANCE_KINDS)}")
        if self.gpus and self.kind != "KIND_GPU":
            raise ValueError("gpus can only be set for KIND_GPU instance groups")

    def to_dict(self) -> dict:
        d: dict = {"count": self.count, "kind": self.kind}
        if self.gpus:
            d["gpus"] = list(self.gpus)
        return d


@dataclass(frozen=True)
class DynamicBatching:
    max_queue_delay_microseconds: int = 0
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_size: int = 0  # 0: unbounded (Triton's default)
    queue_timeout_microseconds: int = 0  # 0: none; else a request queued longer is rejected (Triton sheds)

    def __post_init__(self) -> None:
        if min(self.max_queue_delay_microseconds, self.max_queue_size, self.queue_timeout_microseconds) < 0:
            raise ValueError("dynamic batching delays, queue sizes and queue timeouts must be >= 0")

    def to_dict(self) -> dict:
        d: dict = {"max_queue_delay_microseconds": self.max_queue_delay_microseconds}
        if self.preferred_batch_size:
            d["preferred_batch_size"] = list(self.preferred_batch_size)
        policy: dict = {}
        if self.max_queue_size:
            policy["max_queue_size"] = self.max_queue_size
        if self.queue_timeout_microseconds:
            policy |= {"default_timeout_microseconds": self.queue_timeout_microseconds, "timeout_action": "REJECT",
                       "allow_timeout_override": True}
        if policy:
            d["default_queue_policy"] = policy
        return d


@dataclass(frozen=True)
class EnsembleStep:
    """One step: `input_map` / `output_map` map the step model's tensor names to ensemble tensors."""

    model_name: str
    input_map: dict[str, str]
    output_map: dict[str, str]

    def to_dict(self) -> dict:
        return {
            "model_name": self.model_name,
            "model_version": -1,
            "input_map": dict(self.input_map),
            "output_map": dict(self.output_map),
        }


@dataclass(frozen=True)
class ModelConfig:
    """A Triton model configuration (the subset rtxserve generates)."""

    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    backend: str | None = None
    platform: str | None = None
    instance_groups: tuple[InstanceGroup, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    ensemble_steps: tuple[EnsembleStep, ...] = ()
    parameters: dict[str, str] = field(default_factory=dict)
    default_model_filename: str | None = None

    def __post_init__(self) -> None:
        check_model_name(self.name)
        if self.max_batch_size < 0:
            raise ValueError(f"{self.name}: max_batch_size must be >= 0")
        if (self.backend is None) == (self.platform is None):
            raise ValueError(f"{self.name}: set exactly one of backend or platform")
        if not self.inputs or not self.outputs:
            raise ValueError(f"{self.name}: a model needs at least one input and one output")
        names = [t.name for t in self.inputs + self.outputs]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: tensor names must be unique, got {names}")
        is_ensemble = self.platform == "ensemble"
        if is_ensemble != bool(self.ensemble_steps):
            raise ValueError(f"{self.name}: ensemble steps go with platform 'ensemble' only")
        if is_ensemble and (self.instance_groups or self.dynamic_batching):
            raise ValueError(f"{self.name}: an ensemble has no instance groups or batcher of its own")
        if is_ensemble:
            self._check_ensemble_wiring()

    def _check_ensemble_wiring(self) -> None:
        available = {t.name for t in self.inputs}
        for step in self.ensemble_steps:
            missing = set(step.input_map.values()) - available
            if missing:
                raise ValueError(
                    f"{self.name}: step {step.model_name} reads {sorted(missing)} before any step writes it"
                )
            available |= set(step.output_map.values())
        unproduced = {t.name for t in self.outputs} - available
        if unproduced:
            raise ValueError(f"{self.name}: no step produces outputs {sorted(unproduced)}")

    def to_dict(self) -> dict:
        """The configuration in the JSON form of Triton's `ModelConfig` message."""
        d: dict = {"name": self.name, "max_batch_size": self.max_batch_size}
        if self.backend:
            d["backend"] = self.backend
        if self.platform:
            d["platform"] = self.platform
        if self.default_model_filename:
            d["default_model_filename"] = self.default_model_filename
        d["input"] = [t.to_dict() for t in self.inputs]
        d["output"] = [t.to_dict() for t in self.outputs]
        if self.instance_groups:
            d["instance_group"] = [g.to_dict() for g in self.instance_groups]
        if self.dynamic_batching:
            d["dynamic_batching"] = self.dynamic_batching.to_dict()
        if self.ensemble_steps:
            d["ensemble_scheduling"] = {"step": [s.to_dict() for s in self.ensemble_steps]}
        if self.parameters:
            d["parameters"] = {k: {"string_value": v} for k, v in self.parameters.items()}
        return d

    def to_pbtxt(self) -> str:
        """Render `config.pbtxt` (raises ValueError if Triton's schema rejects the config)."""
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2

        try:
            message = json_format.ParseDict(self.to_dict(), model_config_pb2.ModelConfig())
        except json_format.ParseError as exc:  # a field or enum Triton does not know
            raise ValueError(f"{self.name}: not a valid Triton model config: {exc}") from exc
        return text_format.MessageToString(message)

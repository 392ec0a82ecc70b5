"""`rtxserve plan DEPLOYMENT`: what each GPU holds, estimated from the artifacts, before anything starts.

What each server takes is estimated in deploy/estimates.py (from the artifacts); here it is packed.

Packing: each vLLM engine goes to the emptiest GPU that holds no other replica of its model (engines of different
models share a card, each with its own share; they start one after another, so that each engine's start-up profile
sees none of the other's allocations); encoder instances are per GPU (Triton's KIND_GPU `count`) on every GPU or on
the ones the model names; "auto" instances are added one at a time, round robin, while they fit. On-demand models
(resident: on-demand) share a swap room instead: all the always-resident ones leave, or deployment.swap_room_gib. A
deployment that does not fit is refused with the per-GPU table.

On a CPU deployment the same sums are held against this host's memory (CPU ONNX Runtime and vLLM's
VLLM_CPU_KVCACHE_SPACE: plan on the box that will run it), and "auto" means one instance: on CPU the cores,
not memory, bound instances.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from .estimates import (
    CPU_DIFFUSION_PROCESS_GIB,
    CPU_ENCODER_INSTANCE_GIB,
    CPU_TRITON_GIB,
    CPU_VLLM_PROCESS_GIB,
    CUDA_HOST_GIB,
    GIB,
    TRITON_PROCESS_GIB,
    VLLM_CONTEXT_GIB,
    Estimate,
    estimate_diffusion,
    estimate_encoder,
    estimate_llm,
)
from .spec import Deployment, DiffusionModel, EncoderModel, LLMModel
from .load import check_artifacts


@dataclass
class Placement:
    model: str
    what: str  # "instances" / "engine" / "engine asleep" (its CUDA context) / "runtime" / "swap room"
    count: int
    gib_each: float

    @property
    def gib(self) -> float:
        return self.count * self.gib_each


@dataclass
class Device:
    name: str  # "GPU 0" / "CPU"
    memory_gib: float
    placements: list[Placement] = field(default_factory=list)

    @property
    def used_gib(self) -> float:
        return sum(p.gib for p in self.placements)

    @property
    def free_gib(self) -> float:
        return self.memory_gib - self.used_gib


@dataclass
class Plan:
    deployment: str
    on_gpu: bool
    devices: list[Device]
    estimates: dict[str, Estimate]
    instances: dict[str, int]  # encoder -> instances per device (auto resolved)
    engines: dict[str, list[int]]  # llm -> the GPU index of each replica
    gpu_memory_utilization: dict[str, float]  # llm -> its engines' share of a GPU
    more: dict[str, int]  # model -> how many more instances (encoders) or engines (LLMs) would fit
    fits: bool = True
    # GPU engines: the KV cache tokens the memory its GPU has left for it holds (what vLLM would give it, were it
    # given all of that), whether or not the max_num_seqs x max_model_len it was planned for fit
    kv_room_tokens: dict[str, int] = field(default_factory=dict)
    on_demand: dict[str, float] = field(default_factory=dict)  # on-demand entry -> GiB on each device once loaded
    swap_room_gib: float = 0.0  # what the on-demand entries share on each device
    warm_together: list[str] = field(default_factory=list)  # on-demand entries, in file order, that fit at once
    cpu_binds: dict[str, str] = field(default_factory=dict)  # CPU box: vLLM engine -> its cores (VLLM_CPU_OMP_THREADS_BIND)
    engine_host_gib: dict[str, tuple[float, float]] = field(default_factory=dict)  # GPU box: llm -> host GiB awake, asleep

    def to_json(self) -> dict:
        out = asdict(self)
        for d, device in zip(out["devices"], self.devices):
            d |= {"used_gib": round(device.used_gib, 3), "free_gib": round(device.free_gib, 3)}
        return out


# ---------------------------------------------------------------------------------------------- packing

def server_host_gib(d: Deployment, p: Plan) -> dict[str, float]:
    """Host memory (RSS) of each server, by its kind: "triton", and each LLM's engine by the LLM's name; what the
    Kubernetes pods request. On a CPU box that is the plan itself (every sum is held against host memory). On a GPU
    box, the processes as measured on CPU (torch or ONNX Runtime loaded) and CUDA's host side: a tritonserver, and a
    stub per python-backend instance (two per entry, an encoder's tokenizer and post-processing, or one per diffusion
    instance); a vLLM engine's API server, engine core and worker. Estimates: `rtxserve plan --measure` measures GPU
    memory, not these."""
    if not d.on_gpu:
        (cpu,) = p.devices
        room = p.swap_room_gib if any(isinstance(m, EncoderModel) for m in d.on_demand) else 0.0
        triton = sum(pl.gib for pl in cpu.placements if pl.what not in ("engine", "swap room")) + room
        return {"triton": triton} | {pl.model: pl.gib for pl in cpu.placements if pl.what == "engine"} | {
            m.name: p.estimates[m.name].gib for m in d.on_demand if isinstance(m, LLMModel)}
    def stub_gib(m: EncoderModel) -> float:
        return (2 * CPU_ENCODER_INSTANCE_GIB if not isinstance(m, DiffusionModel)
                else p.instances[m.name] * (CPU_DIFFUSION_PROCESS_GIB + CUDA_HOST_GIB))

    stubs = sum(stub_gib(m) for m in d.encoders if m.resident == "always")
    if p.on_demand:  # as many as the swap room holds at once (the smallest first), each as large as the largest
        fit, used = 0, 0.0
        for gib in sorted(p.on_demand.values()):
            if used + gib > p.swap_room_gib:
                break
            fit, used = fit + 1, used + gib
        stubs += sum(sorted((stub_gib(m) for m in d.on_demand), reverse=True)[:fit])
    return ({"triton": CPU_TRITON_GIB + CUDA_HOST_GIB + stubs} if d.encoders else {}) | {
        m.name: max(p.engine_host_gib[m.name]) for m in d.vllm_models}


def _engine_host_gib(d: Deployment, m: LLMModel, e: Estimate) -> tuple[float, float]:
    """A GPU engine's host memory awake and asleep (GiB): the largest is what its pod's limit and doctor must hold.
    Asleep, vLLM keeps in pinned host memory what its sleep-mode backend offloads: the runtime and CUDA-graph pools at
    every level, and at level 1 the weights (and LoRA slots) too (vLLM 0.32's sleep_mode_backend.suspend): about
    15.5 GiB for an 8B model in fp16. An always-resident engine never sleeps."""
    awake = CPU_VLLM_PROCESS_GIB + CUDA_HOST_GIB
    if m.resident != "on-demand":
        return awake, awake
    kept = ("runtime", "cuda_graphs") + (("weights", "lora") if sleep_level(d) == 1 else ())
    return awake, awake + sum(e.parts.get(k, 0.0) for k in kept)


def sleep_level(d: Deployment) -> int:
    """How the box's on-demand GPU engines sleep (the gateway's sleep_level setting, 1 by default)."""
    return int(d.gateway.settings.get("sleep_level", 1))


def host_memory_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / GIB


def plan(d: Deployment, *, check: bool = True) -> Plan:
    """Estimate every instance and pack them; `Plan.fits` is False (and the table says where) when they do not."""
    if check:
        check_artifacts(d)
    estimates = {m.name: estimate_diffusion(d, m) if isinstance(m, DiffusionModel) else estimate_encoder(d, m)
                 for m in d.encoders} | {m.name: estimate_llm(d, m) for m in d.vllm_models}
    if d.on_gpu:
        devices = [Device(f"GPU {i}", d.gpus.memory_gib) for i in range(d.gpus.count)]
    else:
        devices = [Device("CPU", round(host_memory_gib(), 1))]
    engines, utilization, shares = _place_engines(d, estimates, devices)
    if d.encoders:
        runtime = TRITON_PROCESS_GIB if d.on_gpu else CPU_TRITON_GIB
        for dev in devices:
            dev.placements.append(Placement("tritonserver", "runtime", 1, runtime))
    instances = {m.name: (1 if m.instances == "auto" else m.instances) for m in d.encoders}
    always = [m for m in d.encoders if m.resident == "always"]
    for m in always:
        for dev in devices:
            dev.placements.append(Placement(m.name, "instances", instances[m.name], estimates[m.name].gib))
    on_demand = {m.name: instances[m.name] * estimates[m.name].gib if isinstance(m, EncoderModel)
                 else shares[m.name] - (VLLM_CONTEXT_GIB if d.on_gpu else 0.0) for m in d.on_demand}
    if on_demand:  # the largest is held free while "auto" instances grow; the room is settled after
        for dev in devices:
            dev.placements.append(Placement("on-demand entries", "swap room", 1, max(on_demand.values())))
    fits = all(dev.free_gib >= 0 for dev in devices)
    if fits:
        _grow_auto_instances(d, always, estimates, devices, instances)
    room, warm = _swap_room(d, devices, on_demand)
    fits = fits and all(dev.free_gib >= 0 for dev in devices)
    more, kv_room = _room_left(d, always, estimates, devices, engines, fits)
    return Plan(d.name, d.on_gpu, devices, estimates, instances, engines, utilization, more,
                fits and (not on_demand or max(on_demand.values()) <= room), kv_room, on_demand, room, warm,
                {} if d.on_gpu else cpu_binds(d, sorted(os.sched_getaffinity(0))),
                {m.name: _engine_host_gib(d, m, estimates[m.name]) for m in d.vllm_models} if d.on_gpu else {})


def _place_engines(d: Deployment, estimates: dict[str, Estimate],
                   devices: list[Device]) -> tuple[dict[str, list[int]], dict[str, float], dict[str, float]]:
    """Each LLM's vLLM engines on the devices, the largest model first: (llm -> the device of each replica, llm -> its
    engines' share of a GPU, llm -> what each engine holds awake, its CUDA context included). An on-demand engine
    holds only its CUDA context while asleep; the rest of its share is in the swap room."""
    engines: dict[str, list[int]] = {}
    utilization: dict[str, float] = {}
    shares: dict[str, float] = {}
    for m in sorted(d.vllm_models, key=lambda m: -estimates[m.name].gib):
        e = estimates[m.name]
        share = e.gib
        if d.on_gpu:  # vLLM holds exactly its share of the card's total (rounded up to the hundredth it is given as),
            # and its CUDA context beside it: the share is of what torch allocates, measured after the context exists
            inside = e.gib - VLLM_CONTEXT_GIB
            utilization[m.name] = min(0.99, math.ceil(100 * inside / d.gpus.total_gib) / 100)
            share = max(share, utilization[m.name] * d.gpus.total_gib + VLLM_CONTEXT_GIB)
        engines[m.name] = []
        for _ in range(m.replicas):  # each replica on a GPU of its own (the spec allows no more replicas than GPUs),
            # the emptiest first; engines of other models may share it, each with its own share
            free = [i for i in range(len(devices)) if i not in engines[m.name]]
            i = max(free, key=lambda i: devices[i].free_gib)
            engines[m.name].append(i)
            if m.resident == "always":
                devices[i].placements.append(Placement(m.name, "engine", 1, share))
            elif d.on_gpu:  # asleep, an engine keeps its CUDA context; awake, the rest of its share is in the swap room
                devices[i].placements.append(Placement(m.name, "engine asleep", 1, VLLM_CONTEXT_GIB))
        shares[m.name] = share
    return engines, utilization, shares


def _grow_auto_instances(d: Deployment, always: list[EncoderModel], estimates: dict[str, Estimate],
                         devices: list[Device], instances: dict[str, int]) -> None:
    """Round robin on a GPU box: one more instance of each "auto" encoder while it fits on every device (at most 64),
    in `instances` and the devices' placements."""
    auto = [m for m in always if m.instances == "auto"] if d.on_gpu else []
    while auto:
        grown = []
        for m in auto:
            gib = estimates[m.name].gib
            if instances[m.name] < 64 and all(dev.free_gib >= gib for dev in devices):
                instances[m.name] += 1
                for dev in devices:
                    next(p for p in dev.placements if p.model == m.name).count += 1
                grown.append(m)
        auto = grown


def _room_left(d: Deployment, always: list[EncoderModel], estimates: dict[str, Estimate], devices: list[Device],
               engines: dict[str, list[int]], fits: bool) -> tuple[dict[str, int], dict[str, int]]:
    """What the packed devices leave room for: (model -> how many more instances or engines of the always-resident
    models fit, GPU engine -> the KV cache tokens its GPU's free memory and its share would hold)."""
    more = {}
    for m in always:
        gib = estimates[m.name].gib
        more[m.name] = max(0, min(int(dev.free_gib // gib) for dev in devices)) if fits else 0
    for m in (m for m in d.vllm_models if m.resident == "always"):
        share = next(p.gib_each for dev in devices for p in dev.placements if p.model == m.name)
        more[m.name] = sum(1 for i, dev in enumerate(devices) if i not in engines[m.name] and dev.free_gib >= share)
    kv_room = {}
    for m in (m for m in d.vllm_models if m.resident == "always") if d.on_gpu else ():
        e = estimates[m.name]
        free = min(devices[i].free_gib for i in engines[m.name])  # each replica's GPU, after everything placed
        share = next(p.gib_each for p in devices[engines[m.name][0]].placements if p.model == m.name)
        kv_room[m.name] = max(0, int((free + share - (e.gib - e.parts["kv_cache"])) * GIB // e.kv_bytes_per_token))
    return more, kv_room


def cpu_binds(d: Deployment, cores: list[int]) -> dict[str, str]:
    """The cores each vLLM engine of a CPU box binds its threads to (VLLM_CPU_OMP_THREADS_BIND): an equal slice for
    each always-resident engine, and one for the on-demand engines, which take turns in it. Nothing (vLLM binds
    every core of its NUMA node) where one slice would do, or where there are fewer cores than slices."""
    slots = [[m.name] for m in d.vllm_models if m.resident == "always"]
    asleep = [m.name for m in d.vllm_models if m.resident == "on-demand"]
    slots += [asleep] if asleep else []
    if len(slots) < 2 or len(cores) < len(slots):
        return {}
    per = len(cores) // len(slots)
    return {name: f"{cores[i * per]}-{cores[(i + 1) * per - 1]}" for i, names in enumerate(slots) for name in names}


def _swap_room(d: Deployment, devices: list[Device], on_demand: dict[str, float]) -> tuple[float, list[str]]:
    """Settle the swap room on every device: deployment.swap_room_gib, or all that the rest leaves; and which
    on-demand entries, in the file's order, fit in it at once. The plan does not fit where the room is over what the
    device has, or the largest on-demand entry does not fit in it even with every other one unloaded."""
    if not on_demand:
        return 0.0, []
    reserved = [next(p for p in dev.placements if p.what == "swap room") for dev in devices]
    left = min(dev.free_gib for dev in devices) + reserved[0].gib_each
    room = d.swap_room_gib if d.swap_room_gib is not None else max(0.0, left)
    for placement in reserved:
        placement.gib_each = room
    warm, used = [], 0.0
    for name, gib in on_demand.items():
        if used + gib <= room:
            warm.append(name)
            used += gib
    return room, warm


def format_plan(p: Plan) -> str:
    lines = []
    for dev in p.devices:
        lines.append(f"{dev.name}: {dev.used_gib:.2f} of {dev.memory_gib:g} GiB planned, "
                     + (f"{dev.free_gib:.2f} GiB left" if dev.free_gib >= 0 else f"OVER by {-dev.free_gib:.2f} GiB"))
        lines.append(f"  {'model':<28} {'what':<10} {'count':>5} {'GiB each':>9} {'GiB':>7}")
        for pl in dev.placements:
            lines.append(f"  {pl.model:<28} {pl.what:<10} {pl.count:>5} {pl.gib_each:>9.3f} {pl.gib:>7.2f}")
    lines.append("")
    lines.append("estimates (GiB per instance or engine):")
    for e in p.estimates.values():
        parts = ", ".join(f"{k} {v:.3f}" for k, v in e.parts.items())
        lines.append(f"  {e.model} ({e.kind}): {e.gib:.3f} = {parts}" + (f"; {'; '.join(e.notes)}" if e.notes else ""))
    for name, share in p.gpu_memory_utilization.items():
        lines.append(f"  {name}: each engine runs with --gpu-memory-utilization {share:.2f}")
    for name, tokens in p.kv_room_tokens.items():
        e = p.estimates[name]
        planned = round(e.parts["kv_cache"] * GIB / e.kv_bytes_per_token)
        lines.append(f"  {name}: its GPU has room for {tokens} tokens of KV cache ({tokens // e.context} sequences of "
                     f"{e.context}); planned {planned}")
    if p.engine_host_gib:
        lines += ["", "host memory of each vLLM engine (GiB; its Kubernetes container requests the larger, doctor "
                  "counts it):"]
        for name, (awake, asleep) in p.engine_host_gib.items():
            lines.append(f"  {name:<28} {awake:>7.2f} awake, {asleep:>7.2f} asleep" + (
                " (never sleeps)" if asleep == awake and name not in p.on_demand else ""))
    if p.on_demand:
        where = "each GPU" if p.on_gpu else "the box"
        lines += ["", f"on demand (loaded when asked for, the least recently used unloaded to make room): a swap room of "
                  f"{p.swap_room_gib:.2f} GiB on {where}; one gateway decides what is loaded for every worker and "
                  "pod (fleet/decider.py)"]
        for name, gib in p.on_demand.items():
            lines.append(f"  {name:<28} {gib:>7.2f} GiB" + ("" if gib <= p.swap_room_gib else "  DOES NOT FIT the room"))
        lines.append(f"  warm together: {', '.join(p.warm_together) or 'none'}" + (
            f" ({len(p.warm_together)} of {len(p.on_demand)}; the others swap in as they are asked for)"
            if len(p.warm_together) < len(p.on_demand) else " (all of them)"))
    if p.fits:
        more = [f"{n}: +{k} {'engine(s)' if n in p.engines else 'instance(s) per ' + ('GPU' if p.on_gpu else 'box')}"
                for n, k in p.more.items() if k > 0]
        if more:
            lines += ["", "would also fit: " + ", ".join(more)]
    else:
        over = [f"{dev.name} by {-dev.free_gib:.2f} GiB" for dev in p.devices if dev.free_gib < 0]
        largest = max(p.on_demand.items(), key=lambda kv: kv[1], default=None)
        if largest and largest[1] > p.swap_room_gib:
            over.append(f"the swap room: {largest[0]} needs {largest[1]:.2f} GiB with every other on-demand entry "
                        f"unloaded, the room is {p.swap_room_gib:.2f} GiB")
        lines += ["", f"DOES NOT FIT: over on {', '.join(over)}"]
    return "\n".join(lines)

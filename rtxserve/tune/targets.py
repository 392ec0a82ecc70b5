"""What `rtxserve tune` tunes: one Triton entry (instances x max_batch_size x queue delay) or one vLLM engine
(--max-num-seqs x --max-num-batched-tokens), each configuration served by freshly started servers."""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path

from core import contract
from core.tasks import TASKS

# The load scenario that exercises each task's route.
SCENARIO_OF_TASK = {name: task.loadtest[0] for name, task in TASKS.items() if task.kind == contract.ENCODER}
class TritonTarget:
    """One Triton entry; each configuration a copy of it (weights hard-linked) with its knobs set."""

    def __init__(self, repository: Path, name: str):
        from serve.entry_config import entry_models, read_config

        self.repository, self.name = repository, name
        config = read_config(entry_models(repository, name)[0] / "config.pbtxt")
        task = config.parameters[contract.PARAM_TASK].string_value if contract.PARAM_TASK in config.parameters else ""
        if task not in SCENARIO_OF_TASK:
            raise ValueError(f"{name} is not a servable encoder entry (task {task or 'none'}); "
                             f"tune takes {', '.join(SCENARIO_OF_TASK)}")
        self.scenario, self.what = SCENARIO_OF_TASK[task], f"{name} ({task}) in {repository}"

    def current(self) -> dict:
        from serve.entry_config import read_batching

        return asdict(read_batching(self.repository, self.name))

    @contextlib.contextmanager
    def serve(self, config: dict, folder: Path):
        from serve.entry_config import Batching, copy_entry, write_batching
        from serve.stack import start_stack

        repo = copy_entry(self.repository, self.name, folder / "repository")
        write_batching(repo, self.name, Batching(**config))
        with start_stack(repo, folder / "logs") as stack:
            yield stack.gateway_url, [stack.triton_metrics_url]

    def apply(self, config: dict) -> str:
        from serve.entry_config import Batching, write_batching

        write_batching(self.repository, self.name, Batching(**config))
        return f"written into {self.repository}/{self.name} and its steps"

    def reproduce(self, config: dict) -> str:
        return (f"rtxserve export onnx CHECKPOINT --name {self.name} --instances {config['instances']} "
                f"--max-batch-size {config['max_batch_size']} --max-queue-delay-us {config['max_queue_delay_us']}")


class VLLMTarget:
    """One vLLM engine (model, adapters and options as `serve vllm` takes them), restarted per configuration."""

    def __init__(self, opts):
        self.opts, self.scenario, self.what = opts, None, f"vLLM serving {opts.served_name} from {opts.model}"

    def current(self) -> dict:
        # None: the flag is not given, and vLLM picks its own default (it depends on the platform and memory)
        return {"max_num_seqs": None, "max_num_batched_tokens": None}

    @contextlib.contextmanager
    def serve(self, config: dict, folder: Path):
        import dataclasses

        from serve.stack import start_gateway, start_vllm

        extra = list(self.opts.extra_args)
        for knob, value in config.items():
            if value is not None:
                extra += [f"--{knob.replace('_', '-')}", str(value)]
        opts = dataclasses.replace(self.opts, extra_args=extra)
        vllm, url = start_vllm(opts, folder, timeout_s=600)
        try:
            gateway, gateway_url = start_gateway("", folder, vllm_url=url)
            try:
                yield gateway_url, [f"{url}/metrics"]
            finally:
                gateway.stop()
        finally:
            vllm.stop()

    def apply(self, config: dict) -> str:
        raise ValueError("--apply writes Triton entries; for vLLM, start it with the recommended flags")

    def reproduce(self, config: dict) -> str:
        flags = " ".join(f"--vllm-arg=--{k.replace('_', '-')}={v}" for k, v in config.items() if v is not None)
        return f"rtxserve serve vllm {self.opts.model} {flags}".strip()

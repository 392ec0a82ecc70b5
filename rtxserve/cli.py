"""The `rtxserve` entry point. It only dispatches: each subcommand's module is imported when it runs,
so `rtxserve loadtest` never pays for torch and the gateway never imports export code."""

from __future__ import annotations

import importlib
import sys

# name -> (module, function, one-line help)
COMMANDS = {
    "fixtures": ("fixture_models.cli", "main", "write small fine-tuned-style checkpoints (no model hub)"),
    "export": ("export.cli", "main", "checkpoint -> validated ONNX -> Triton model repository entry"),
    "serve": ("rtxserve.cli", "serve_main", "run tritonserver, vLLM or the gateway; up / status / down a whole deployment"),
    "plan": ("deploy.cli", "plan_main", "a deployment's GPU memory plan, from its artifacts, before anything starts"),
    "doctor": ("deploy.doctor", "main", "check this box for a deployment (GPUs, driver, memory, ports, disk, tools)"),
    "deploy": ("deploy.cli", "main", "render a deployment as compose, systemd and Kubernetes files; bundle it for air-gapped boxes"),
    "adapters": ("deploy.cli", "adapters_main", "load or unload a LoRA adapter in a running deployment, without a restart"),
    "keys": ("serve.gateway.access.keys_cli", "main", "create, list and revoke the gateway's API keys"),
    "eval": ("rtxserve.eval_cli", "main", "is what a box serves what was trained? a model's reference set sent through "
             "the gateway and compared with the framework's own answers"),
    "promote": ("rtxserve.promote.cli", "main", "put a new fine-tune in front of the old one on a running box: eval "
                "gate, shadow, canary, switch, rollback window; back to the old one at the first breach"),
    "loadtest": ("loadtest.cli", "main", "run a locust scenario and write a latency report"),
    "capacity": ("loadtest.cli", "capacity_main", "the most requests/s a box holds within an SLO (ramp, bisect, confirm); boxes for a target"),
    "tune": ("rtxserve.tune", "main", "search a Triton entry's instances x batching, or a vLLM engine's, for the most load held within an SLO"),
    "bench": ("bench.cli", "main", "benchmarks (gateway: B1, export: B2, batching: B3/B5, llm: B4 (G2/G3 on a GPU), accuracy: B6, soak: R18, reliability: R3/R14)"),
    "demo": ("rtxserve.demo", "main", "the whole path on CPU: fixtures, export, serve, load test, report"),
}


def _usage() -> str:
    lines = ["usage: rtxserve COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `rtxserve COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if argv[0] in {"-V", "--version"}:
        from core import __version__

        print(f"rtxserve {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"rtxserve: error: unknown command {argv[0]!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, function, _ = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module_name), function)(argv[1:]) or 0)


def serve_main(argv: list[str]) -> int:
    """`rtxserve serve`: serve's one-server commands (triton, vllm, gateway) and deploy's whole-box ones (up,
    status, down) under one command; serve never imports deploy, so they meet here, on the roof."""
    import argparse

    from deploy import box_cli
    from serve import cli as serve_cli

    parser = argparse.ArgumentParser(prog="rtxserve serve", description="Run a server in the foreground, or a whole box.")
    sub = parser.add_subparsers(dest="server", required=True)
    serve_cli.add_commands(sub)
    box_cli.add_commands(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

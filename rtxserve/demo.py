"""`rtxserve demo` (what `make demo` runs): the whole path on CPU, end to end, with real servers.

fixtures -> export (ONNX with parity; a LoRA adapter packaged for vLLM) -> a deployment file, brought up
with `serve up` (tritonserver + vLLM + gateway) -> locust on /v1/classify, then streamed chat on
/v1/chat/completions -> report headlines -> `serve down`.
Everything lands in one work folder (default .rtxserve/demo); rerunning replaces it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import yaml


def _say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _options(argv: list[str]) -> argparse.Namespace:
    """The demo's options; its progress goes to stderr (readiness polls left out)."""
    parser = argparse.ArgumentParser(prog="rtxserve demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(".rtxserve/demo"))
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--instances", type=int, default=1, help="model instances in Triton")
    parser.add_argument("--chat-duration", type=float, default=10.0, help="seconds of streamed chat load")
    parser.add_argument("--chat-users", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polls are not news
    return args


def _export(work: Path, name: str, instances: int) -> tuple[Path, Path, Path]:
    """Steps 1-3: the fixture classifier exported as the Triton entry `name`, and the fixture Llama with its LoRA
    adapter packaged for vLLM; returns (the Triton repository, the Llama's folder, the adapter's package)."""
    from export.encoders.encoder import EncoderOptions, export_text_classification
    from fixture_models.llm import write_llm_with_adapters
    from fixture_models.text import write_text_classifier
    from export.llm.llm import LLMOptions, export_llm
    from export.triton.entry import EntryOptions

    _say(f"1/6 writing a fine-tuned-style BERT classifier checkpoint to {work / 'checkpoint'}")
    checkpoint = write_text_classifier(work / "checkpoint")
    _say("2/6 exporting it to ONNX (validated against PyTorch) and a Triton ensemble")
    repository = work / "model_repository"
    command = f"rtxserve export onnx {checkpoint} --task text-classification --name {name} --repository {repository} --force"
    export_text_classification(checkpoint, EntryOptions(name=name, instances=instances), repository,
                               EncoderOptions(force=True, command=command))
    _say(f"3/6 writing a tiny Llama with a LoRA adapter to {work / 'llm'}; packaging the adapter for vLLM")
    llm = write_llm_with_adapters(work / "llm")
    adapter = export_llm(llm / "adapter-a", work / "llm-package" / "demo-adapter", LLMOptions(force=True)).out
    return repository, llm, adapter


def _print_results(result, chat) -> bool:
    """The two load tests' headlines and reports on stdout; whether both ran without an error (and chat streamed)."""
    from loadtest.report.report import headline

    stream = chat.summary.streaming
    print()
    print(f"rtxserve demo, classify: {headline(result.summary)}")
    print(f"report: {result.report} (self-contained page: {result.report.with_suffix('.html')})")
    if stream:
        print(f"rtxserve demo, streamed chat: TTFT P50 {stream['ttft_ms']['p50']:.1f} ms, P99 {stream['ttft_ms']['p99']:.1f} ms, "
              f"{stream['output_tokens_per_s']:.1f} output tokens/s, errors {chat.summary.errors}/{chat.summary.requests}")
    else:
        print(f"rtxserve demo, streamed chat: no successful stream ({chat.summary.errors} errors)")
    print(f"report: {chat.report} (self-contained page: {chat.report.with_suffix('.html')})")
    return result.summary.errors == 0 and result.summary.qps > 0 and chat.summary.errors == 0 and bool(stream)


def main(argv: list[str]) -> int:
    """The six steps (the deployment brought down whatever happens once it is up); 0 when both load tests ran clean."""
    args = _options(argv)
    from loadtest.runner import LoadSpec, run, scenario_options
    from deploy.spec import DeploymentError
    from deploy.load import load_deployment
    from deploy.box import down, up
    from serve.launcher import ServerStartError, free_port

    work = args.workdir.resolve()
    name = "demo_classifier"
    repository, llm, adapter = _export(work, name, args.instances)
    _say("4/6 writing the deployment file and bringing it up (`rtxserve serve up`): tritonserver, vLLM (the base "
         "model and its adapter) and the gateway")
    ports = {k: free_port() for k in ("gateway", "triton_http", "triton_grpc", "triton_metrics", "vllm")}
    # No drain on `serve down`: nothing but the demo routes to this gateway (a deployment keeps the 5 s default)
    spec = {"name": "demo", "ports": ports, "gateway": {"settings": {"drain_s": 0}},
            "models": [{"name": name, "kind": "encoder", "path": str(repository / name), "instances": args.instances},
                       {"name": "demo-llm", "kind": "llm", "path": str(llm / "base"), "adapters": {"demo-adapter": str(adapter)},
                        "max_model_len": 512}]}
    deployment_file = work / "deployment.yaml"
    deployment_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    try:
        deployment = load_deployment(deployment_file)
        run_folder = up(deployment, root=work / "run", log=_say)
    except (DeploymentError, ServerStartError) as exc:
        _say(f"error: {exc}")
        return 1
    gateway_url = f"http://127.0.0.1:{ports['gateway']}"
    try:
        _say(f"gateway ready at {gateway_url}; `rtxserve serve status {run_folder}` shows every server")
        _say(f"5/6 load test /v1/classify: {args.users} users for {args.duration:g}s")
        result = run(LoadSpec(gateway_url, scenario_options(model=name), users=args.users, duration_s=args.duration,
                              warmup_s=args.warmup, scrape=[f"http://127.0.0.1:{ports['triton_metrics']}/metrics"]),
                     work / "report", log=_say)
        _say(f"6/6 load test streamed /v1/chat/completions on the adapter: {args.chat_users} users for {args.chat_duration:g}s")
        chat = run(LoadSpec(gateway_url, scenario_options(scenario="chat", model="demo-adapter", output_len=32),
                            users=args.chat_users, duration_s=args.chat_duration,
                            warmup_s=min(args.warmup, args.chat_duration / 4), scrape=[f"http://127.0.0.1:{ports['vllm']}/metrics"]),
                   work / "report-chat", log=_say)
    finally:
        _say("stopping servers (`rtxserve serve down`)")
        down(run_folder, log=_say)
    return 0 if _print_results(result, chat) else 1

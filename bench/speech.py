"""`rtxserve bench speech`: benchmark B11 (shared BENCH.md), the real-time factor of a Whisper served here.

The fixture Whisper (fixture_models.speech.write_whisper) is exported with `export speech` and served by the real vLLM
(compiled, as a deployment runs it) behind the real gateway. `rtxserve loadtest --scenario transcribe` uploads the
fixture's clips (2 to 3 s of espeak-ng speech) with 1 and then 4 users in a closed loop, in alternating order over
several rounds; each figure is the median over rounds. The real-time factor is seconds of audio transcribed per
second of wall time (all requests together); per request, its audio over its latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from core.machine import machine

from .record import Benchmark, Files, Progress

MODEL = "bench-whisper"
PLOT = "b11.png"
FILES = Files("bench-speech.json", "bench-speech.md", plots=(PLOT,))


@contextlib.contextmanager
def _stack(work: Path, progress):
    """(gateway URL, the fixture's audio folder)."""
    from fixture_models.speech import write_whisper
    from export.speech.whisper import export_speech
    from serve.stack import start_gateway, start_vllm
    from serve.vllm_server import VLLMOptions

    progress("training the fixture Whisper and exporting it")
    source = write_whisper(work / "whisper")
    package = export_speech(source, work / "package").out
    progress("starting vLLM (compiled) and the gateway")
    vllm, vllm_url = start_vllm(VLLMOptions(model=package, served_name=MODEL, max_model_len=448), work / "logs")
    try:
        gateway, url = start_gateway("", work / "logs", vllm_url=vllm_url)
        try:
            yield url, source / "audio"
        finally:
            gateway.stop()
    finally:
        vllm.stop()


def _figures(summary) -> dict:
    speech, latency = summary.speech, summary.latency_ms
    return {"rtf": round(speech["real_time_factor"], 3), "rtf_p50": round(speech["per_request_rtf"]["p50"], 3),
            "p50_ms": round(latency["p50"], 1), "p99_ms": round(latency["p99"], 1), "requests": summary.requests,
            "errors": summary.errors}


def run(out: Path, *, rounds: int = 3, duration_s: float = 15.0, users: tuple[int, ...] = (1, 4),
        progress=print) -> dict:
    from loadtest.runner import LoadSpec, run as loadtest, scenario_options

    out.mkdir(parents=True, exist_ok=True)
    per_round: dict[int, list[dict]] = {n: [] for n in users}
    with tempfile.TemporaryDirectory(prefix="rtxserve-b11-") as tmp, _stack(Path(tmp), progress) as (url, audio):
        options = scenario_options(scenario="transcribe", model=MODEL, audio_dir=str(audio), language="en")
        for i in range(rounds):
            for n in (users if i % 2 == 0 else tuple(reversed(users))):
                summary = loadtest(LoadSpec(url, options, users=n, duration_s=duration_s, warmup_s=2),
                                   Path(tmp) / f"run-{i}-{n}", log=lambda m: None).summary
                if not summary.speech:
                    raise RuntimeError(f"no successful transcription with {n} users: {summary.error_kinds}")
                per_round[n].append(_figures(summary))
                progress(f"round {i + 1}/{rounds}, {n} user(s): real-time factor {per_round[n][-1]['rtf']}, "
                         f"P50 {per_round[n][-1]['p50_ms']} ms")
    medians = {str(n): {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in per_round.items()}
    result = {"bench": "B11", "cpu": machine(), "rounds": rounds, "duration_s": duration_s, "model": "fixture Whisper "
              "(d_model 128, 2+2 layers, 10 s windows)", "users": medians,
              "per_round": {str(n): rs for n, rs in per_round.items()}}
    (out / FILES.json).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / PLOT)
    (out / FILES.page).write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    rows = "\n".join(f"| {n} | {f['rtf']:.2f} | {f['rtf_p50']:.2f} | {f['p50_ms']:.0f} | {f['p99_ms']:.0f} | "
                     f"{f['errors']:g} |" for n, f in result["users"].items())
    return f"""# B11: speech to text, real-time factor (the fixture Whisper through the gateway and vLLM)

![Real-time factor at 1 and 4 users, round by round]({PLOT})

{result['model']}, served by vLLM on this CPU behind the gateway; `rtxserve loadtest --scenario transcribe` uploads
its 2-3 s clips in a closed loop, median of {result['rounds']} alternating rounds x {result['duration_s']:g} s.
CPU: {result['cpu']}. The real-time factor is seconds of audio transcribed per second of wall time, all requests
together; per request, its audio over its latency (P50).

| users | real-time factor | per request (P50) | P50 ms | P99 ms | errors |
|---|---|---|---|---|---|
{rows}
"""


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (n, figures) in enumerate(result["users"].items()):
        ax.bar(i, figures["rtf"], color="tab:blue", alpha=0.75, label="median" if i == 0 else None)
        rounds = [r["rtf"] for r in result["per_round"][n]]
        ax.scatter([i] * len(rounds), rounds, color="black", s=10, zorder=3, label="rounds" if i == 0 else None)
    ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="real time (1 s of audio per s)")
    ax.set_xticks(range(len(result["users"])), [f"{n} user(s)" for n in result["users"]])
    ax.set_ylabel("seconds of audio per second of wall time")
    ax.legend(fontsize=8)
    best = max(f["rtf"] for f in result["users"].values())
    return save(fig, path, f"B11: the fixture Whisper through the gateway, real-time factor up to {best:.1f}")


# --- `rtxserve bench speech` ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of load per level and round")
    parser.add_argument("--users", default="1,4", help="closed-loop users per level, comma-separated")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-speech-<time>)")


def _users(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(n) for n in args.users.split(","))


def check_arguments(args: argparse.Namespace) -> str | None:
    try:
        users = _users(args)
    except ValueError:
        return "--users: use numbers separated by commas"
    if args.rounds < 1 or args.duration <= 4 or min(users) < 1:
        return "need --rounds >= 1, --duration > 4 (2 s of warm-up) and --users >= 1"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, rounds=args.rounds, duration_s=args.duration, users=_users(args), progress=progress)


BENCHMARK = Benchmark(
    name="speech", id="B11", title="speech real-time factor",
    help="B11: the real-time factor of the fixture Whisper through the gateway and vLLM, 1 and 4 users",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

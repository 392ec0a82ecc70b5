"""B14: people beside a batch. An interactive chat load alone, then beside a batch of the Batch API, on one vLLM CPU
engine behind the gateway.

Interactive users (a closed loop with a think time between requests) stream completions and time their first token;
the batch (`/v1/files` + `/v1/batches`, completions of the same size) is sent by the gateway at batch priority. Three
phases per row: the users alone (their TTFT), the batch alone (what the box serves when nobody else asks: its
capacity in requests/s), then both at once, the users running until the batch ends. Targets (issue 42): the users'
TTFT P99 beside the batch <= 1.2x alone, and the batch's throughput beside them >= 0.8x the throughput the box has
left (its capacity less the users' requests/s).

vLLM runs the model in its engine core (serve.vllm_server.TWO_PROCESSES), as B1s does: in its default layout a
worker process spins a core's worth of CPU waiting, which on a 2-core box left the users' P99 to the scheduler's
share-out (453 and 662 ms in two runs, 102 ms in a third).

Three rows, each its own engine and gateway: the box as a deployment renders it by default (vLLM first come first
served; a batch's requests yield to people's first tokens, serve/gateway/fleet/yielding.py; the model's gate at the
engine's max_num_seqs); the same with batches not yielding (the box before); and vLLM's `--scheduling-policy priority`
with the gateway passing each request's priority (`vllm_priority`: batch lines 10, people 0) beside the yielding.
Then the frontier: the box defaults with 1, 2, 4 and 8 of the batch's requests in flight (batch_concurrency), what
each share of the engine costs the users' TTFT and buys the batch, against both targets at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path

import numpy as np

from .record import Benchmark, Files, Progress

SERVED = "bench-llm"
PLOT = "b14.png"
FILES = Files("bench-priority.json", "bench-priority.md", plots=(PLOT,))
MAX_NUM_SEQS = 16  # a deployment's default (deploy/spec.py), and so the gateway's derived gate for the model
# Each row: vLLM's scheduling policy and the gateway's settings beyond a box's defaults. The targets are read off the
# first: the box as `serve up` renders it (vLLM first come first served, batches yielding to people, the model's
# gate at max_num_seqs, batch_concurrency as it comes)
ROWS = {"box defaults": ("fcfs", {}),
        "batches not yielding": ("fcfs", {"RTXSERVE_BATCH_YIELDS": "false"}),
        "vLLM priority": ("priority", {"RTXSERVE_VLLM_PRIORITY": "true"})}
MEASURED = "box defaults"
# The frontier: the box defaults again, one engine, the gateway restarted with the batch's requests in flight
# (batch_concurrency) at each of these, a shorter batch beside the same users: what each share of the engine costs
# the people and buys the batch.
FRONTIER = (1, 2, 4, 8)
FRONTIER_BATCH = 1200  # at 1 in flight about 40 s on this box: a P99 of some 250 of the users' requests
TARGETS = {"ttft_p99_ratio": ("<=", 1.2), "batch_share_of_left": (">=", 0.8)}


async def _users(url: str, users: int, think_s: float, max_tokens: int, until, prompts: list[str]) -> dict:
    """`users` closed loops until `until()` says stop: their TTFTs (ms) and requests/s."""
    import httpx

    from .llm import complete

    ttfts, failed = [], []

    async def user(i: int, client) -> None:
        n = 0
        while not until():
            done = await complete(client, url, SERVED, prompts[(i * 7 + n) % len(prompts)], max_tokens)
            (ttfts.append(done.ttft_s * 1000) if done.ok else failed.append(done.error))
            n += 1
            await asyncio.sleep(think_s)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(user(i, client) for i in range(users)))
    seconds = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"{len(failed)} interactive requests failed, e.g. {failed[0]}")
    return {"requests": len(ttfts), "rps": round(len(ttfts) / seconds, 3), "ttft_p50_ms": round(float(np.percentile(
        ttfts, 50)), 2), "ttft_p99_ms": round(float(np.percentile(ttfts, 99)), 2), "seconds": round(seconds, 2),
        "ttfts_ms": [round(t, 2) for t in ttfts]}


async def _batch(url: str, requests: int, max_tokens: int, prompts: list[str], progress) -> dict:
    """One batch of `requests` completions through the Batch API, from its creation to its end: requests/s."""
    import httpx

    lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": SERVED, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0}}).encode() + b"\n" for i in range(requests))
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        file = (await client.post("/v1/files", files={"file": ("b.jsonl", lines)}, data={"purpose": "batch"})).json()
        started = time.perf_counter()
        batch = (await client.post("/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/completions",
                                                        "completion_window": "24h"})).json()
        shown = 0.0
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.1)
            batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
            if time.perf_counter() - shown > 10:
                shown = time.perf_counter()
                progress(f"  batch: {batch['request_counts']['completed']} of {requests} answered")
        seconds = time.perf_counter() - started
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["completed"] != requests:
        raise RuntimeError(f"the batch ended {batch['status']} with {counts}")
    return {"requests": requests, "seconds": round(seconds, 2), "rps": round(requests / seconds, 3)}


async def _beside(url: str, opts: dict, prompts: list[str], progress) -> tuple[dict, dict]:
    finished = asyncio.Event()

    async def batch():
        try:
            return await _batch(url, opts["batch"], opts["max_tokens"], prompts, progress)
        finally:
            finished.set()

    return await asyncio.gather(batch(), _users(url, opts["users"], opts["think_s"], opts["max_tokens"],
                                                finished.is_set, prompts))


def _engine(model: Path, out: Path, folder: str, policy: str = "fcfs"):
    """One vLLM CPU engine of the model at MAX_NUM_SEQS with `policy`, its core in the engine process: (server, URL)."""
    from serve.stack import start_vllm
    from serve.vllm_server import TWO_PROCESSES, VLLMOptions

    extra = ["--max-num-seqs", str(MAX_NUM_SEQS), *(["--scheduling-policy", "priority"] if policy == "priority" else [])]
    return start_vllm(VLLMOptions(model=model, served_name=SERVED, max_model_len=2048, extra_args=extra),
                      out / f"vllm-{folder}", timeout_s=900, env=TWO_PROCESSES)


def _gateway(engine_url: str, out: Path, folder: str, settings: dict[str, str]):
    """The gateway in front of it, the model gated at MAX_NUM_SEQS, with `settings` beyond those: (server, URL)."""
    from serve.stack import start_gateway

    env = {"RTXSERVE_BATCH_DIR": str(out / f"batches-{folder}"),
           "RTXSERVE_MODEL_CONCURRENCY": json.dumps({SERVED: MAX_NUM_SEQS}), **settings}
    return start_gateway("", out / f"gateway-{folder}", vllm_url=engine_url, extra_env=env)


def _row(model: Path, out: Path, name: str, opts: dict, progress) -> dict:
    from .llm import prompts_for

    prompts = prompts_for(seed=14, count=64)
    policy, settings = ROWS[name]
    folder = name.replace(" ", "-")
    with contextlib.ExitStack() as stack:
        engine, engine_url = _engine(model, out, folder, policy)
        stack.callback(engine.stop)
        if opts["batch_concurrency"]:
            settings = {**settings, "RTXSERVE_BATCH_CONCURRENCY": str(opts["batch_concurrency"])}
        gateway, url = _gateway(engine_url, out, folder, settings)
        stack.callback(gateway.stop)
        warm = time.perf_counter() + 5  # a new engine's first requests are slower: not the users' figures
        asyncio.run(_users(url, opts["users"], opts["think_s"], opts["max_tokens"], lambda: time.perf_counter() >= warm,
                           prompts))
        deadline = time.perf_counter() + opts["alone_s"]
        alone = asyncio.run(_users(url, opts["users"], opts["think_s"], opts["max_tokens"],
                                   lambda: time.perf_counter() >= deadline, prompts))
        progress(f"B14 {name}: users alone: TTFT P99 {alone['ttft_p99_ms']:.1f} ms, {alone['rps']:.2f} requests/s")
        capacity = asyncio.run(_batch(url, opts["batch"], opts["max_tokens"], prompts, progress))
        progress(f"B14 {name}: batch alone: {capacity['rps']:.1f} requests/s")
        batch, users = asyncio.run(_beside(url, opts, prompts, progress))
    left = capacity["rps"] - users["rps"]
    row = {"users_alone": alone, "batch_alone": capacity, "users_beside": users, "batch_beside": batch,
           "ttft_p99_ratio": round(users["ttft_p99_ms"] / alone["ttft_p99_ms"], 3),
           "ttft_p50_ratio": round(users["ttft_p50_ms"] / alone["ttft_p50_ms"], 3),
           "left_rps": round(left, 3), "batch_share_of_left": round(batch["rps"] / left, 3) if left > 0 else None}
    progress(f"B14 {name}: beside the batch: users' TTFT P99 {users['ttft_p99_ms']:.1f} ms "
             f"({row['ttft_p99_ratio']}x alone); batch {batch['rps']:.1f} requests/s ({row['batch_share_of_left']}x "
             "what the box had left)")
    return row


def _frontier(model: Path, out: Path, opts: dict, left_rps: float, alone: dict, progress) -> list[dict]:
    """Per batch_concurrency in FRONTIER, on one engine: the users' TTFT beside a batch of FRONTIER_BATCH, as ratios
    to `alone` (the box defaults row's), and the batch's requests/s as a share of `left_rps` (what the box defaults
    row's engine had left at the gateway's default batch_concurrency)."""
    from .llm import prompts_for

    prompts = prompts_for(seed=14, count=64)
    points = []
    engine, engine_url = _engine(model, out, "frontier")
    try:
        for n in FRONTIER:
            gateway, url = _gateway(engine_url, out, f"frontier-{n}", {"RTXSERVE_BATCH_CONCURRENCY": str(n)})
            try:
                warm = time.perf_counter() + 3
                asyncio.run(_users(url, opts["users"], opts["think_s"], opts["max_tokens"],
                                   lambda: time.perf_counter() >= warm, prompts))
                batch, users = asyncio.run(_beside(url, {**opts, "batch": FRONTIER_BATCH}, prompts, progress))
            finally:
                gateway.stop()
            point = {"batch_concurrency": n, "ttft_p50_ms": users["ttft_p50_ms"], "ttft_p99_ms": users["ttft_p99_ms"],
                     "ttft_p50_ratio": round(users["ttft_p50_ms"] / alone["ttft_p50_ms"], 3),
                     "ttft_p99_ratio": round(users["ttft_p99_ms"] / alone["ttft_p99_ms"], 3),
                     "batch_rps": batch["rps"], "batch_share_of_left": round(batch["rps"] / left_rps, 3)}
            progress(f"B14 frontier, {n} of the batch in flight: users' TTFT P50 {point['ttft_p50_ratio']}x / P99 "
                     f"{point['ttft_p99_ratio']}x alone; batch {batch['rps']:.1f} requests/s "
                     f"({point['batch_share_of_left']}x what the box had left)")
            points.append(point)
    finally:
        engine.stop()
    return points


def run(out: Path, *, batch: int = 4000, users: int = 2, think_s: float = 0.25, max_tokens: int = 16,
        batch_concurrency: int | None = None, alone_s: float = 40.0, progress=print) -> dict:
    from core.machine import machine
    from fixture_models.llm import write_llm

    model = write_llm(out / "tiny-llama", max_length=2048)
    opts = {"batch": batch, "users": users, "think_s": think_s, "max_tokens": max_tokens,
            "batch_concurrency": batch_concurrency, "alone_s": alone_s}
    rows = {name: _row(model, out, name, opts, progress) for name in ROWS}
    frontier = _frontier(model, out, opts, rows[MEASURED]["left_rps"], rows[MEASURED]["users_alone"], progress)
    result = {"bench": "B14", "model": "fixture Llama (tiny), one vLLM CPU engine", "machine": machine(), **opts,
              "rows": rows, "frontier": frontier,
              "verdict": {k: _met(rows[MEASURED][k], op, v) for k, (op, v) in TARGETS.items()}}
    return FILES.save(out, result, markdown, plot)


def _met(value, op: str, target: float) -> bool:
    return value is not None and (value <= target if op == "<=" else value >= target)


def markdown(result: dict) -> str:
    lines = [f"## B14: people beside a batch ({result['model']}; {result['users']} users streaming completions of "
             f"{result['max_tokens']} tokens with {result['think_s']} s between them, beside a batch of "
             f"{result['batch']} such completions, "
             f"{result['batch_concurrency'] or 'batch_concurrency as it comes,'} in flight; vLLM max_num_seqs "
             f"{MAX_NUM_SEQS}, the gateway's gate for the model the same)", "",
             f"Machine: {result['machine']}", "", f"![TTFT and throughput per phase]({PLOT})", "",
             "| box | users' TTFT P50 / P99 ms, alone | beside the batch | P50 / P99 ratio | users' requests alone / "
             "beside | batch requests/s alone | beside | box left (alone - users) | batch / left |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        a, b = row["users_alone"], row["users_beside"]
        lines.append(f"| {name} | {a['ttft_p50_ms']} / {a['ttft_p99_ms']} | {b['ttft_p50_ms']} / {b['ttft_p99_ms']} | "
                     f"{row.get('ttft_p50_ratio', '–')}x / {row['ttft_p99_ratio']}x | "
                     f"{a.get('requests', '–')} / {b.get('requests', '–')} | {row['batch_alone']['rps']} | "
                     f"{row['batch_beside']['rps']} | "
                     f"{row['left_rps']} | {row['batch_share_of_left']}x |")
    lines += ["", f"| target ({MEASURED}) | measured | verdict |", "|---|---|---|"]
    for key, (op, value) in TARGETS.items():
        verdict = "met" if result["verdict"][key] else "**missed**"
        lines.append(f"| {key} {op} {value}x | {result['rows'][MEASURED][key]}x | {verdict} |")
    if result.get("frontier"):
        lines += ["", f"The frontier ({MEASURED}, one engine, a batch of {FRONTIER_BATCH} beside the same users; "
                  f"ratios to the {MEASURED} row's users alone, the batch's requests/s to what that row's engine had left):", "",
                  "| batch requests in flight | users' TTFT P50 / P99 ms | P50 / P99 ratio | batch requests/s | "
                  "batch / left |", "|---|---|---|---|---|"]
        lines += [f"| {f['batch_concurrency']} | {f['ttft_p50_ms']} / {f['ttft_p99_ms']} | {f['ttft_p50_ratio']}x / "
                  f"{f['ttft_p99_ratio']}x | {f['batch_rps']} | {f['batch_share_of_left']}x |"
                  for f in result["frontier"]]
        lines += ["", frontier_reading(result["frontier"])]
    return "\n".join(lines) + "\n"


def frontier_reading(frontier: list[dict]) -> str:
    """What the frontier says of the targets: the least share of the engine that meets both, or why none does."""
    both = [f for f in frontier if all(_met(f[key], op, value) for key, (op, value) in TARGETS.items())]
    if both:
        return (f"With {both[0]['batch_concurrency']} of the batch's requests in flight the box meets both targets "
                f"(users' P99 {both[0]['ttft_p99_ratio']}x, the batch {both[0]['batch_share_of_left']}x of what is "
                f"left): `batch_concurrency: {both[0]['batch_concurrency']}` on this box.")
    least = min(frontier, key=lambda f: f["batch_concurrency"])
    p99, share = TARGETS["ttft_p99_ratio"][1], TARGETS["batch_share_of_left"][1]
    gentle = [f for f in frontier if _met(f["ttft_p99_ratio"], *TARGETS["ttft_p99_ratio"])]
    if gentle:  # the shares that keep people within their target starve the batch
        best = max(gentle, key=lambda f: f["batch_share_of_left"])
        trade = (f"The shares that keep the users' TTFT P99 within {p99}x alone give the batch at most "
                 f"{best['batch_share_of_left']}x of what is left ({best['batch_concurrency']} in flight: P99 "
                 f"{best['ttft_p99_ratio']}x; target >= {share}x)")
    else:
        trade = (f"The least there is, {least['batch_concurrency']} of the batch's requests in flight, already puts the "
                 f"users' TTFT P99 at {least['ttft_p99_ratio']}x and P50 at {least['ttft_p50_ratio']}x alone (target "
                 f"P99 <= {p99}x) while the batch gets {least['batch_share_of_left']}x of what is left (target >= "
                 f"{share}x)")
    return (f"No share of the engine meets both targets here. {trade}: a person's request shares the engine's steps "
            "with whatever of the batch is running, and no gate or hold at the gateway removes a request already in the "
            "engine. What would meet them is the batch on an engine of its own (its own cores or card), so that people "
            "never share its steps; on this box that engine would take cores from the people's.")


def plot(result: dict, path: Path) -> Path:
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    fig, (ttft, rps, edge) = plt.subplots(1, 3, figsize=(17, 4.6))
    for i, row in enumerate(result["rows"].values()):
        for j, (phase, label) in enumerate((("users_alone", "alone"), ("users_beside", "beside the batch"))):
            data = row[phase]["ttfts_ms"]
            box = ttft.boxplot([data], positions=[i * 3 + j], widths=0.8, whis=(1, 99), showfliers=False,
                               patch_artist=True)
            box["boxes"][0].set_facecolor(("tab:blue", "tab:orange")[j])
            ttft.scatter([i * 3 + j], [row[phase]["ttft_p99_ms"]], marker="v", color="black", zorder=3)
        rps.bar([i * 3, i * 3 + 1], [row["left_rps"], row["batch_beside"]["rps"]],
                color=["tab:grey", "tab:green"], alpha=0.85)
    ticks = [x for i in range(len(result["rows"])) for x in (i * 3, i * 3 + 1)]
    for ax, phases in ((ttft, ("alone", "beside")), (rps, ("box left", "batch"))):
        ax.set_xticks(ticks, [w for _ in result["rows"] for w in phases], fontsize=8)
        for i, name in enumerate(result["rows"]):  # each row's name once, under its pair
            ax.text(i * 3 + 0.5, -0.13, name, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=9)
    ttft.set_ylabel("users' TTFT (ms; whiskers P1-P99, triangle P99)")
    rps.set_ylabel("requests/s")
    points = result.get("frontier") or []
    if points:
        x = [f["batch_concurrency"] for f in points]
        edge.plot(x, [f["ttft_p99_ratio"] for f in points], "v-", color="tab:orange", label="users' TTFT P99 / alone")
        edge.plot(x, [f["ttft_p50_ratio"] for f in points], "o--", color="tab:orange", alpha=0.6,
                  label="users' TTFT P50 / alone")
        edge.plot(x, [f["batch_share_of_left"] for f in points], "s-", color="tab:green", label="batch / box left")
        for key, colour in (("ttft_p99_ratio", "tab:orange"), ("batch_share_of_left", "tab:green")):
            edge.axhline(TARGETS[key][1], color=colour, linestyle=":", linewidth=1)
        edge.set_xscale("log", base=2)
        edge.set_xticks(x, [str(n) for n in x])
        edge.set_xlabel("the batch's requests in flight (batch_concurrency); dotted: the targets")
        edge.set_ylabel("ratio")
        edge.legend(fontsize=8)
    else:
        edge.set_visible(False)
    return save(fig, path, "B14: people's TTFT beside a batch, and the batch's share of what they leave")


# --- `rtxserve bench priority` --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=4000, help="requests in the batch (on a 2-core box about 40 s "
                        "beside the users: a P99 of some 250 of their requests)")
    parser.add_argument("--users", type=int, default=2, help="interactive users")
    parser.add_argument("--think", type=float, default=0.25, help="seconds a user waits between requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch-concurrency", type=int, help="the gateway's batch_concurrency (default: the "
                        "gateway's own)")
    parser.add_argument("--alone", type=float, default=40.0, help="seconds of the users alone")
    parser.add_argument("--out", type=Path, help="folder (default reports/bench-priority-<time>)")


def check_arguments(args: argparse.Namespace) -> str | None:
    if min(args.batch, args.users, args.max_tokens, args.batch_concurrency or 1) < 1 or args.alone <= 0 or args.think < 0:
        return "need --batch, --users, --max-tokens, --batch-concurrency >= 1, --alone > 0 and --think >= 0"
    return None


def run_parsed(args: argparse.Namespace, out: Path, progress: Progress) -> dict:
    return run(out, batch=args.batch, users=args.users, think_s=args.think, max_tokens=args.max_tokens,
               batch_concurrency=args.batch_concurrency, alone_s=args.alone, progress=progress)


BENCHMARK = Benchmark(
    name="priority", id="B14", title="people beside a batch",
    help="B14: interactive TTFT alone and beside a Batch API batch, on a box's default settings (and without "
         "batches yielding, and with vLLM's priority scheduling)",
    add_arguments=add_arguments, validate=check_arguments, run=run_parsed, markdown=markdown, files=FILES)

"""B1s (shared BENCH.md): what the gateway costs a stream, against the floor of a plain reverse proxy.

One vLLM server on the fixture Llama; `vllm bench serve` (random-token prompts, `ignore_eos`, streamed
completions) calls it directly, through nginx (bench/proxy.py), through the Python relay (bench/relay.py: the least a
Python front door does, the floor of any gateway in Python), through the gateway and, where `make setup-bench`
installed it, through LiteLLM's proxy (the peer), in rotating order over several rounds at each concurrency. Each
figure is the median over rounds: TTFT and inter-token latency P50 / P99 as `vllm bench serve` measures them, output
tokens/s as the engine counts them over its run.

Two layouts of vLLM: `core`, the model in its engine core (two processes, serve.vllm_server.TWO_PROCESSES), and
`three`, vLLM's own default on a CPU (API server, engine core, and a worker process running the model while the engine
core spins waiting for it, a core's worth of CPU). `serve up` runs the first on a box of up to SMALL_BOX_CORES cores
and the second on bigger ones (serve.vllm_server.box_layout_env); by default B1s measures `core`, and `three` too where
`serve up` runs that. Targets (issue 53) at the highest concurrency: on `core`, TTFT P50 within +5 ms of nginx's and
output tokens/s at least 0.97x nginx's; on the layout `serve up` runs on this box, tokens/s at least 0.9x nginx's,
TTFT P50 within +20 ms of it, and LiteLLM's proxy, measured in the same rounds, beaten on both.

The paths of one round send the same prompts (one seed), so vLLM runs without prefix caching: otherwise the
first path of a round pays the prefills and the others hit the cache. On a 2-core box the `three` layout leaves the API
server, the front ends and the clients one core between them; there vLLM held back whole answers, headers included,
for a few hundred ms in some rounds of every path (direct too: 206 ms TTFT P50 in one round against 14 ms in the next;
through a front end in most rounds), and the figures said more of the scheduler's share-out than of the front ends:
what made `serve up` run two processes on small boxes. A request that fails (vllm bench serve's own parser sometimes
trips over an event split across reads behind nginx) is counted in the table, not fatal.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from pathlib import Path

from .proxy import LITELLM, path_table
from .relay import NAME as RELAY

FIGURES = {"ttft_p50_ms": "median_ttft_ms", "ttft_p99_ms": "p99_ttft_ms", "itl_p50_ms": "median_itl_ms",
           "itl_p99_ms": "p99_itl_ms", "failed": "failed"}  # and output_tokens_s: the engine's count (_engine_tokens)
SERVED = "bench-llm"
LAYOUTS = {"core": "the model in the engine core (two processes: VLLM_ENABLE_V1_MULTIPROCESSING=0)",
           "three": "API server, engine core and a worker process (vLLM's own default on a CPU)"}
_LAYOUT_ENV = {"core": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "three": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
# (figure, op, value) at the highest concurrency: the gateway against nginx, and LiteLLM where measured; `core`'s on
# that layout, `served`'s on the layout `serve up` runs on this box
TARGETS = {"core": (("tokens_s_vs_proxy", ">=", 0.97), ("ttft_p50_over_proxy_ms", "<=", 5.0)),
           "served": (("tokens_s_vs_proxy", ">=", 0.9), ("ttft_p50_over_proxy_ms", "<=", 20.0),
                      ("tokens_s_vs_litellm", ">", 1.0), ("ttft_p50_over_litellm_ms", "<", 0.0))}


def served_layout() -> str:
    """The layout `serve up` runs an engine in on this box (serve.vllm_server.box_layout_env)."""
    from serve.vllm_server import box_layout_env

    return "core" if box_layout_env(len(os.sched_getaffinity(0)), bound=False) else "three"


def default_layouts() -> tuple[str, ...]:
    """`core`, and the layout `serve up` runs here where that is another."""
    return tuple(dict.fromkeys(("core", served_layout())))


def targets(layout: str) -> tuple[tuple[str, str, float], ...]:
    """What `layout` is judged on: `core`'s targets on it, the served ones where `serve up` runs it here."""
    return (TARGETS["core"] if layout == "core" else ()) + (TARGETS["served"] if layout == served_layout() else ())


def plot_name(layout: str) -> str:
    """bench/gateway.py, which runs B1s, saves each layout's plot beside its own."""
    return f"b1s-{layout}.png"


def run(out: Path, *, rounds: int = 3, concurrency: tuple[int, ...] = (4, 16), prompts: int = 300, input_len: int = 60,
        output_len: int = 64, layout: str = "core", profile_s: float = 0.0, progress=print) -> dict:
    """Each path's figures over the rounds, its front end's CPU per 1,000 tokens (nginx's, the gateway's, LiteLLM's)
    and, with `profile_s`, where the gateway's CPU goes while it relays streams at the highest concurrency."""
    from fixture_models.llm import write_llm
    from serve.stack import start_gateway, start_vllm
    from serve.vllm_server import VLLMOptions

    from .accuracy import RandomWorkload, vllm_bench_serve
    from .profile import cpu_seconds
    from .proxy import litellm_proxy, plain_proxy
    from .relay import python_relay

    model = write_llm(out / "tiny-llama")  # a fast backend: what the gateway adds shows most
    progress(f"starting vLLM, the gateway and nginx for {model}")
    levels = []
    with contextlib.ExitStack() as stack:
        vllm, direct = start_vllm(VLLMOptions(model=model, served_name=SERVED, max_model_len=512,
                                                  extra_args=["--no-enable-prefix-caching"]), out, timeout_s=900,
                                  env=_LAYOUT_ENV[layout])
        stack.callback(vllm.stop)
        gateway, via_gateway = start_gateway("", out, vllm_url=direct)
        stack.callback(gateway.stop)
        proxy, proxy_pid = stack.enter_context(plain_proxy(direct.removeprefix("http://"), Path(stack.enter_context(
            tempfile.TemporaryDirectory())), "/v1/models"))
        relay, relay_pid = stack.enter_context(python_relay(direct, out, "/v1/models", app="passthrough"))
        urls = {"direct": direct, "proxy": proxy, RELAY: relay, "gateway": via_gateway}
        pids = {"proxy": proxy_pid, RELAY: relay_pid, "gateway": gateway.process.pid}  # the front ends whose CPU is counted
        if LITELLM.exists():
            urls["litellm"], pids["litellm"] = stack.enter_context(litellm_proxy(direct, SERVED, out / "litellm"))
        paths = tuple(urls)
        for c in concurrency:
            figures: dict[str, dict[str, list[float]]] = {
                p: {k: [] for k in (*FIGURES, "output_tokens_s", *(["cpu_ms_per_1k_tokens"] if p in pids else []))}
                for p in paths}
            for r in range(rounds):
                for path in paths[r % len(paths):] + paths[:r % len(paths)]:  # each path first in turn
                    before, cpu_before = _engine_tokens(direct), cpu_seconds(pids[path]) if path in pids else 0.0
                    result = vllm_bench_serve(urls[path], SERVED, model, out / f"c{c}-round-{r + 1}" / path,
                                              RandomWorkload(prompts, c, input_len, output_len, seed=r),
                                              metrics="ttft,itl", failures_ok=True)
                    tokens = _engine_tokens(direct) - before
                    for k, key in FIGURES.items():
                        figures[path][k].append(float(result[key]))
                    figures[path]["output_tokens_s"].append(tokens / result["duration"])
                    if path in pids:  # its CPU over the whole run (vllm bench serve's start included: idle)
                        figures[path]["cpu_ms_per_1k_tokens"].append(
                            (cpu_seconds(pids[path]) - cpu_before) * 1e6 / max(tokens, 1))
                    progress(f"streams, {c} concurrent, round {r + 1}/{rounds}, {path}: TTFT P50 "
                             f"{result['median_ttft_ms']:.1f} ms, {figures[path]['output_tokens_s'][-1]:.0f} tokens/s")
            levels.append(_level(c, figures))
        profiled = {}
        if profile_s:
            progress(f"profiling the gateway's streams at {max(concurrency)} concurrent for {profile_s:g} s (py-spy)")
            try:
                profiled = _profile(via_gateway, gateway.process.pid, max(concurrency), output_len, profile_s,
                                    out / "b1s-profile.raw")
            except RuntimeError as exc:  # no py-spy, or no ptrace here: the page says so, the figures stand
                profiled = {"error": str(exc)}
    from .proxy import litellm_version

    return {"bench": "B1s", "model": "fixture Llama (tiny), vLLM CPU", **_judged(layout, levels[-1]), "rounds": rounds,
            "prompts": prompts, "input_len": input_len, "output_len": output_len, "litellm": litellm_version(),
            "levels": levels, **({"profile": profiled} if profiled else {})}


def _level(concurrency: int, figures: dict[str, dict[str, list[float]]]) -> dict:
    """One concurrency's figures: each path's medians over the rounds, the rounds, and the gateway against nginx and
    LiteLLM (where measured), the Python relay against nginx."""
    medians = {p: {k: round(statistics.median(v), 2) for k, v in f.items()} for p, f in figures.items()}
    gateway = medians["gateway"]
    return {"concurrency": concurrency, "medians": medians, "rounds": figures,
            **{f"ttft_p50_over_{p}_ms": round(gateway["ttft_p50_ms"] - medians[p]["ttft_p50_ms"], 2)
               for p in ("proxy", "litellm") if p in medians},
            **{f"tokens_s_vs_{p}": round(gateway["output_tokens_s"] / medians[p]["output_tokens_s"], 3)
               for p in ("proxy", "litellm") if p in medians},
            # the same against nginx for the Python relay: what any front door in Python reaches here
            "relay": {"ttft_p50_over_proxy_ms": round(medians[RELAY]["ttft_p50_ms"] - medians["proxy"]["ttft_p50_ms"], 2),
                      "tokens_s_vs_proxy": round(medians[RELAY]["output_tokens_s"]
                                                 / medians["proxy"]["output_tokens_s"], 3)}}


def _judged(layout: str, top: dict) -> dict:
    """The layout, as the page names it, and its targets judged at the highest concurrency (`top`)."""
    judged = [target for target in targets(layout) if target[0] in top]
    served = f", as `serve up` runs it on this box ({len(os.sched_getaffinity(0))} cores)" \
        if layout == served_layout() else ""
    return {"layout": layout, "vllm_layout": LAYOUTS[layout] + served, "targets": judged,
            "verdict": {target_name(*target): met(top[target[0]], *target[1:]) for target in judged}}


def _profile(url: str, pid: int, concurrency: int, output_len: int, seconds: float, raw: Path) -> dict:
    """The gateway relaying `concurrency` streamed completions at a time (a closed loop of httpx streams, started before
    the sampling so that it sees only the relay), sampled by py-spy for `seconds`: where its CPU goes per stream."""
    import asyncio

    import httpx

    from . import profile

    async def load(until: float) -> int:
        body = {"model": SERVED, "prompt": "the order arrived on tuesday and", "max_tokens": output_len,
                "ignore_eos": True, "stream": True}
        done = 0

        async def one(client: httpx.AsyncClient) -> None:
            nonlocal done
            while asyncio.get_running_loop().time() < until:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    async for _ in response.aiter_raw():
                        pass
                done += 1

        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
            await asyncio.gather(*(one(client) for _ in range(concurrency)))
        return done

    async def measured() -> int:
        start = asyncio.get_running_loop().time()
        task = asyncio.create_task(load(start + seconds + 4))
        await asyncio.sleep(2)  # streams under way
        with profile.recording(pid, seconds, raw):
            await asyncio.sleep(seconds)
        return await task

    streams = asyncio.run(measured())
    with open(raw) as stacks:
        return {"concurrency": concurrency, "seconds": seconds, "streams": streams, **profile.summarize(stacks)}


def met(value: float, op: str, target: float) -> bool:
    return {">=": value >= target, "<=": value <= target, ">": value > target, "<": value < target}[op]


def verdict_table(title: str, targets, top: dict) -> list[str]:
    """B1's and B1s's targets (`targets`: (figure, op, value)) as a table: each one measured at the top level `top`
    (where it was), its verdict, and the Python relay's figure (top["relay"], where measured) against the same target."""
    relay = top.get("relay", {})
    lines = ["", f"| target ({title}) | measured | verdict | the Python relay |", "|---|---|---|---|"]
    for key, op, value in targets:
        if key in top:
            floor = f"{relay[key]} ({'meets' if met(relay[key], op, value) else 'misses'} it)" if key in relay else "–"
            verdict = "met" if met(top[key], op, value) else "**missed**"
            lines.append(f"| {key} {op} {value:g} | {top[key]} | {verdict} | {floor} |")
    return lines


def target_name(key: str, op: str, value: float) -> str:
    """A target as its verdict is keyed (one figure may have two targets: `core`'s and the served one)."""
    return f"{key} {op} {value:g}"


def _engine_tokens(vllm_url: str) -> float:
    """The tokens vLLM has generated so far, by its own counter. A path's tokens/s is counted by the engine, not by the
    client: `vllm bench serve` reads the usage a front end reports, and LiteLLM's proxy reports its own count of the
    text (its tokenizer, not the model's: twice the engine's here)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "vllm:generation_tokens" for sample in family.samples
               if sample.name.endswith("_total"))


def markdown(result: dict) -> str:
    lines = [f"## B1s: streams ({result['model']}; `vllm bench serve`, random {result['input_len']} in / "
             f"{result['output_len']} out, ignore_eos, {result['prompts']} prompts; median of {result['rounds']} "
             f"rotating rounds; vLLM with {result.get('vllm_layout', 'its default layout')})", "",
             f"![TTFT and tokens/s per path]({plot_name(result.get('layout', 'core'))})", "",
             *path_table(result["levels"], "concurrent", [("TTFT P50 ms", "ttft_p50_ms"), ("TTFT P99 ms", "ttft_p99_ms"),
                                                          ("ITL P50 ms", "itl_p50_ms"), ("ITL P99 ms", "itl_p99_ms"),
                                                          ("output tokens/s", "output_tokens_s"),
                                                          ("failed requests", "failed"),
                                                          ("front end CPU-ms / 1k tokens", "cpu_ms_per_1k_tokens")])]
    peer = "tokens_s_vs_litellm" in result["levels"][0]
    lines += ["", "| concurrent | TTFT P50 ms, gateway - proxy | tokens/s, gateway / proxy |"
              + (" TTFT P50, gateway - LiteLLM | tokens/s, gateway / LiteLLM (above 1: ahead) |" if peer else ""),
              "|---|---|---|" + ("---|---|" if peer else "")]
    lines += [f"| {level['concurrency']} | {level['ttft_p50_over_proxy_ms']:+} | {level['tokens_s_vs_proxy']} |"
              + (f" {level['ttft_p50_over_litellm_ms']:+} | {level['tokens_s_vs_litellm']} |" if peer else "")
              for level in result["levels"]]
    lines += ["", f"LiteLLM {result['litellm']} as the peer (one worker, its `text-completion-openai/` provider)." if peer
              else "LiteLLM's proxy was not measured: `make setup-bench` installs it in .envs/litellm."]
    if "verdict" in result and not result["verdict"]:
        lines += ["", "Not judged: `serve up` runs another layout on this box; measured to show what that one avoids."]
    elif result.get("verdict"):
        top = result["levels"][-1]
        lines += verdict_table(f"{top['concurrency']} concurrent, gateway against nginx (proxy) and LiteLLM",
                               result["targets"] if "targets" in result else TARGETS[result["layout"]], top)
        if "relay" in top:
            lines += ["", "The Python relay (bench/relay.py's passthrough): uvicorn as the gateway runs it, each request "
                      "sent on with the gateway's client (aiohttp) and its answer relayed chunk by chunk, nothing parsed."]
    profiled = result.get("profile", {})
    if "parts" in profiled:
        from . import profile

        lines += ["", *profile.markdown(profiled, f"relaying {profiled['concurrency']} streams at a time, "
                                        f"{profiled['seconds']:g} s, {profiled['streams']} streams")]
    elif profiled:
        lines += ["", f"The gateway was not profiled: {profiled['error']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path:
    """Per concurrency: TTFT P50 and output tokens/s of each path, the rounds as dots."""
    from loadtest.report.plots import pyplot, save

    plt = pyplot()
    levels = result["levels"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, figure, label in ((axes[0], "ttft_p50_ms", "TTFT P50, ms"), (axes[1], "output_tokens_s", "output tokens/s")):
        paths = list(levels[0]["medians"])
        width = 0.8 / len(paths)
        for i, (p, colour) in enumerate(zip(paths, ("tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:red"))):
            xs = [j + (i - (len(paths) - 1) / 2) * width for j in range(len(levels))]
            ax.bar(xs, [lv["medians"][p][figure] for lv in levels], width=width, color=colour, alpha=0.75, label=p)
            for x, lv in zip(xs, levels):
                ax.scatter([x] * len(lv["rounds"][p][figure]), lv["rounds"][p][figure], color="black", s=8, zorder=3)
        ax.set_xticks(range(len(levels)), [f"{lv['concurrency']} concurrent" for lv in levels])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    return save(fig, path, "B1s: streams direct, through nginx, a Python relay, the gateway and LiteLLM where measured "
                           "(bars: median; dots: rounds)")

"""`make bench` (`rtxserve bench all`): every CPU benchmark in turn, then BENCHMARKS.md: the machine, and each
benchmark's own page under the command that measured it."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

from core.machine import machine

# name -> (arguments after `rtxserve bench`, the page it writes)
BENCHES = {
    "B1 gateway overhead": (["gateway"], "bench-gateway.md"),
    "B2 exported encoder": (["export"], "bench-export.md"),
    "B3 / B5 Triton batching and instances": (["batching"], "bench-batching.md"),
    "B4 vLLM continuous batching": (["llm"], "bench-llm.md"),
    "B6 measurement accuracy": (["accuracy"], "bench-accuracy.md"),
    "B7 object detection": (["detection"], "bench-detection.md"),
    "B8 quantised LLMs": (["quantize"], "bench-quantize.md"),
    "B9 Triton response cache": (["cache"], "bench-cache.md"),
    "B10 cache-aware routing": (["affinity"], "bench-affinity.md"),
    "B11 speech real-time factor": (["speech"], "bench-speech.md"),
    "R3 / R14 overload and per-key limits": (["reliability"], "reliability.md"),
}


def previous_sections(page: Path) -> dict[str, str]:
    """Each benchmark's section of an existing BENCHMARKS.md (heading, command and page), by title."""
    if not page.exists():
        return {}
    parts = re.split(r"^## ", page.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0]: "## " + part.rstrip("\n") for part in parts}


def run(out: Path, only: list[str] | None = None, log=print) -> Path:
    """Run every benchmark (or those whose title holds one of `only`; the others keep their last pages from
    `out`, or else their sections of the current BENCHMARKS.md), then write BENCHMARKS.md with the plots copied
    next to it into bench/figures/."""
    from bench.cli import main as bench
    from loadtest.pages import versions

    figures = Path("bench/figures")
    figures.mkdir(parents=True, exist_ok=True)
    timings_path = out / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    earlier = previous_sections(Path("BENCHMARKS.md"))
    sections = []
    for title, (args, page) in BENCHES.items():
        folder = out / args[0]
        command = ["rtxserve", "bench", *args, "--out", str(folder)]
        if not only or any(o in title for o in only):
            log(f"== {title}: {shlex.join(command)}")
            started = time.monotonic()
            try:
                code = bench([*args, "--out", str(folder)])
            except Exception as exc:  # noqa: BLE001 (one benchmark's crash must not lose the others' pages)
                log(f"{title} crashed: {type(exc).__name__}: {exc}")
                code = 1
            timings[title] = {"minutes": round((time.monotonic() - started) / 60, 1), "exit": code,
                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "commit": versions()["git commit"]}
        done = timings.get(title, {})
        if not done and title in earlier:  # neither run now nor in `out`: keep what BENCHMARKS.md says of it
            sections.append(earlier[title])
            continue
        if done.get("exit") == 0 and (folder / page).exists():
            body = (folder / page).read_text()
        else:
            body = f"**failed** (exit {done.get('exit')}); run the command to see why." if done else "not run yet."

        def keep(match: re.Match) -> str:
            image = folder / match.group(2)
            if not image.exists():
                return match.group(0)
            shutil.copyfile(image, figures / f"{args[0]}-{image.name}")
            return f"![{match.group(1)}](bench/figures/{args[0]}-{image.name})"

        body = re.sub(r"^#", "###", re.sub(r"!\[([^]]*)\]\(([^)/]+\.png)\)", keep, body), flags=re.M)
        when = f" ({done['minutes']} min, {done['when']}, at commit {done.get('commit', '?')})" if done else ""
        sections.append(f"## {title}\n\n`{shlex.join(command)}`{when}\n\n{body}")
    timings_path.write_text(json.dumps(timings, indent=2))
    page = f"""# Benchmarks

Last written on {machine()}; each section says when and at which commit it was measured, the machines differ (most
sections name their CPU); {', '.join(f'{k} {v}' for k, v in versions().items())}.
CPU figures are ratios of two things measured side by side in one run (shared/BENCH.md); absolute times on
this shared machine are not comparable between runs. Regenerate with `make bench`
(`python -m bench.all reports/bench B6` reruns one and keeps the others).

""" + "\n\n".join(sections) + "\n"
    path = Path("BENCHMARKS.md")
    path.write_text(page)
    return path


if __name__ == "__main__":
    print(run(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("reports/bench"), sys.argv[2:] or None))

"""`make bench` (`python -m bench.all reports/bench`): every benchmark record that `make bench` takes
(bench/registry.py), in turn, then BENCHMARKS.md: the machine, and each benchmark's own page under the command that
measured it."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import time
from pathlib import Path

from core.machine import machine

from .cli import main as bench
from .record import Benchmark
from .registry import BENCHMARKS

FIGURES = Path("bench/figures")  # the plots BENCHMARKS.md shows, copied from each benchmark's folder


def previous_sections(page: Path) -> dict[str, str]:
    """Each benchmark's section of an existing BENCHMARKS.md (heading, command and page), by title."""
    if not page.exists():
        return {}
    parts = re.split(r"^## ", page.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0]: "## " + part.rstrip("\n") for part in parts}


def _measure(benchmark: Benchmark, folder: Path, log) -> dict:
    """Run it as `rtxserve bench NAME --out FOLDER` does: its exit code, minutes, when and at which commit."""
    from loadtest.report.pages import versions

    started = time.monotonic()
    try:
        code = bench([benchmark.name, "--out", str(folder)])
    except Exception as exc:  # noqa: BLE001 (one benchmark's crash must not lose the others' pages)
        log(f"{benchmark.section} crashed: {type(exc).__name__}: {exc}")
        code = 1
    return {"minutes": round((time.monotonic() - started) / 60, 1), "exit": code,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": versions()["git commit"]}


def _section(benchmark: Benchmark, folder: Path, command: list[str], done: dict) -> str:
    """Its section: the command and its page, the page's plots copied into bench/figures/ and its headings a level
    down; where it failed or never ran, says so."""
    page = folder / benchmark.files.page
    if done.get("exit") == 0 and page.exists():
        body = page.read_text()
    else:
        body = f"**failed** (exit {done.get('exit')}); run the command to see why." if done else "not run yet."

    def keep(match: re.Match) -> str:
        image = folder / match.group(2)
        if not image.exists():
            return match.group(0)
        shutil.copyfile(image, FIGURES / f"{benchmark.name}-{image.name}")
        return f"![{match.group(1)}](bench/figures/{benchmark.name}-{image.name})"

    body = re.sub(r"^#", "###", re.sub(r"!\[([^]]*)\]\(([^)/]+\.png)\)", keep, body), flags=re.M)
    when = f" ({done['minutes']} min, {done['when']}, at commit {done.get('commit', '?')})" if done else ""
    return f"## {benchmark.section}\n\n`{shlex.join(command)}`{when}\n\n{body}"


def _asked(benchmark: Benchmark, asked: str) -> bool:
    """Whether `asked` names the benchmark: one of its ids exactly (B1 is not B10), its sub-command, or words of its
    title."""
    return asked in benchmark.id.split(" / ") or asked == benchmark.name or asked in benchmark.title


def run(out: Path, only: list[str] | None = None, log=print) -> Path:
    """Run every benchmark `make bench` takes (or those `only` names: _asked; the others keep
    their last pages from `out`, or else their sections of the current BENCHMARKS.md), then write BENCHMARKS.md with
    the plots copied next to it into bench/figures/."""
    from loadtest.report.pages import versions

    FIGURES.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    timings_path = out / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    earlier = previous_sections(Path("BENCHMARKS.md"))
    sections = []
    for benchmark in (b for b in BENCHMARKS if b.in_make_bench):
        title, folder = benchmark.section, out / benchmark.name
        command = ["rtxserve", "bench", benchmark.name, "--out", str(folder)]
        if not only or any(_asked(benchmark, o) for o in only):
            log(f"== {title}: {shlex.join(command)}")
            timings[title] = _measure(benchmark, folder, log)
            timings_path.write_text(json.dumps(timings, indent=2))  # a run stopped later keeps what this one measured
        done = timings.get(title, {})
        if not done and title in earlier:  # neither run now nor in `out`: keep what BENCHMARKS.md says of it
            sections.append(earlier[title])
        else:
            sections.append(_section(benchmark, folder, command, done))
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


def main(argv: list[str] | None = None) -> int:
    taken = [b for b in BENCHMARKS if b.in_make_bench]
    parser = argparse.ArgumentParser(prog="python -m bench.all", description="Run the benchmarks `make bench` takes "
                                     "and write BENCHMARKS.md (those named again, the others keeping their pages).")
    parser.add_argument("out", nargs="?", type=Path, default=Path("reports/bench"),
                        help="folder of the benchmarks' reports (default: reports/bench)")
    parser.add_argument("only", nargs="*", help="run only these again: an id (" + ", ".join(b.id for b in taken)
                        + "), a sub-command or words of a title")
    args = parser.parse_args(argv)
    unknown = [o for o in args.only if not any(_asked(b, o) for b in taken)]
    if unknown:
        parser.error(f"no benchmark is {', '.join(unknown)}")
    print(run(args.out, args.only or None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

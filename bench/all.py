"""`make bench` (`rtxserve bench all`): every CPU benchmark in turn, then BENCHMARKS.md: the machine, and each
benchmark's own page under the command that measured it."""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

# name -> (arguments after `rtxserve bench`, the page it writes)
BENCHES = {
    "B1 gateway overhead": (["gateway"], "bench-gateway.md"),
    "B2 exported encoder": (["export"], "bench-export.md"),
    "B3 / B5 Triton batching and instances": (["batching"], "bench-batching.md"),
    "B4 vLLM continuous batching": (["llm"], "bench-llm.md"),
    "B6 measurement accuracy": (["accuracy"], "bench-accuracy.md"),
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    flags = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.+)", info).group(1)
        found = sorted(set(re.findall(r"\b(avx2|avx512f|avx512_bf16|amx_tile|amx_bf16)\b", info)))
        flags = f"; {' '.join(found)}" if found else ""
    except (OSError, AttributeError):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}{flags}; {os.cpu_count()} cores; {memory:.0f} GiB; {platform.system()} {platform.release()}; Python {platform.python_version()}"


def run(out: Path, only: list[str] | None = None, log=print) -> Path:
    from bench.cli import main as bench
    from loadtest.pages import versions

    sections = []
    for title, (args, page) in BENCHES.items():
        if only and not any(o in title for o in only):
            continue
        folder = out / args[0]
        command = ["rtxserve", "bench", *args, "--out", str(folder)]
        log(f"== {title}: {shlex.join(command)}")
        started = time.monotonic()
        code = bench([*args, "--out", str(folder)])
        took = time.monotonic() - started
        body = (folder / page).read_text() if code == 0 and (folder / page).exists() else f"**failed** (exit {code}); see the log above."
        body = re.sub(r"!\[([^]]*)\]\(([^)/]+\.png)\)", lambda m: f"![{m.group(1)}]({folder / m.group(2)})", body)
        body = re.sub(r"^#", "###", body, flags=re.M)
        sections.append(f"## {title}\n\n`{shlex.join(command)}` ({took / 60:.1f} min)\n\n{body}")
    page = f"""# Benchmarks

Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}; {', '.join(f'{k} {v}' for k, v in versions().items())}.
CPU figures are ratios of two things measured side by side in one run (shared/BENCH.md); absolute times on
this shared machine are not comparable between runs. Regenerate with `make bench`.

""" + "\n\n".join(sections) + "\n"
    path = Path("BENCHMARKS.md")
    path.write_text(page)
    return path


if __name__ == "__main__":
    print(run(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("reports/bench"), sys.argv[2:] or None))

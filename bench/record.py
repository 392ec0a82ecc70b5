"""What a benchmark is, once: the record each benchmark module declares at its foot (`BENCHMARK = Benchmark(...)`).
`rtxserve bench` (bench/cli.py) makes a sub-command of each record in bench/registry.py, checks its arguments and
runs it; `make bench` (bench/all.py) runs those it takes and copies their pages and plots into BENCHMARKS.md. The
file names are declared here once (`Files`) and read by the module that writes them, the CLI that lists them and
BENCHMARKS.md. This module imports nothing of bench/, so that every benchmark can import it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str], None]  # where a benchmark says what it is doing (the CLI: stderr)


@dataclass(frozen=True)
class Files:
    """What a benchmark writes into its folder: its figures (JSON), its page (Markdown, which shows the plots by
    their bare names) and its plots. A plot a run may leave out (B1s with --streams '') is listed all the same."""

    json: str
    page: str
    plots: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.json.endswith(".json") or not self.page.endswith(".md") or \
                not all(p.endswith(".png") for p in self.plots):
            raise ValueError(f"a benchmark writes NAME.json, NAME.md and NAME.png plots, not {self}")

    def __iter__(self) -> Iterator[str]:
        return iter((self.json, self.page, *self.plots))

    def save(self, out: Path, result: dict, markdown: Callable[[dict], str],
             plot: Callable[[dict, Path], object] | None = None) -> dict:
        """Write a run's figures (`result`, as JSON), its plot (`plot(result, out / the first plot's name)`) and its
        page: every benchmark's last step. Its figures, returned."""
        import json

        (out / self.json).write_text(json.dumps(result, indent=2) + "\n")
        if plot is not None:
            plot(result, out / self.plots[0])
        (out / self.page).write_text(markdown(result))
        return result


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its sub-command, how to parse, check and run it, its page, its files."""

    name: str  # the sub-command: `rtxserve bench NAME`; its folder under `make bench`'s
    id: str  # shared BENCH.md's id (RELIABILITY.md's for R...): "B1", "B3 / B5"
    title: str  # what it measures, in a few words: BENCHMARKS.md's section is "ID TITLE"
    help: str  # the sub-command's help in `rtxserve bench --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its options, --out included
    validate: Callable[[argparse.Namespace], str | None]  # why the parsed options cannot run, or None
    run: Callable[[argparse.Namespace, Path, Progress], dict]  # run it into the folder: its figures
    markdown: Callable[[dict], str]  # the figures as the page it saves and the CLI prints
    files: Files
    in_make_bench: bool = True  # `make bench` runs it (R18's soak is ten minutes of one gateway: on demand)

    def __post_init__(self):
        if not re.fullmatch(r"[a-z]+", self.name) or not re.fullmatch(r"[BGR]\d+( / [BGR]\d+)*", self.id):
            raise ValueError(f"benchmark {self.name!r} ({self.id!r}): the name is lower-case letters, the id "
                             "BENCH.md's (B1, or B3 / B5)")

    @property
    def section(self) -> str:
        """Its heading in BENCHMARKS.md (which keeps an earlier run's section under the same heading)."""
        return f"{self.id} {self.title}"

"""`rtxserve bench` and `make bench` over the benchmark records (bench/registry.py): each record is a sub-command
with its help, arguments that cannot run are refused before anything starts, the parsed ones reach the
benchmark's own `run`, and `make bench` puts each page it runs into BENCHMARKS.md under its section. Nothing is
measured here: the benchmarks' `run` are stand-ins."""

import argparse
import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import bench
from bench import all as make_bench
from bench import cli
from bench.record import Benchmark, Files
from bench.registry import BENCHMARKS, BY_NAME


class Ran(Exception):
    """Raised by a stand-in `run`: what it was called with."""


def record_calls(monkeypatch, name: str) -> None:
    def run(*args, **kwargs):
        raise Ran(args, kwargs)

    monkeypatch.setattr(f"bench.{name}.run", run)


def called(name: str, argv: list[str]) -> tuple[tuple, dict]:
    with pytest.raises(Ran) as ran:
        cli.main([name, *argv, "--out", "unused"])
    return ran.value.args


def test_every_module_with_a_record_is_registered_once():
    declared = [m.BENCHMARK for m in (importlib.import_module(f"bench.{info.name}")
                                      for info in pkgutil.iter_modules(bench.__path__)) if hasattr(m, "BENCHMARK")]
    assert sorted(b.name for b in declared) == sorted(BY_NAME) and len(BY_NAME) == len(BENCHMARKS)
    assert len({b.section for b in BENCHMARKS}) == len(BENCHMARKS)
    assert len({name for b in BENCHMARKS for name in b.files}) == sum(len(list(b.files)) for b in BENCHMARKS)


def test_each_record_is_a_subcommand_with_its_help_and_an_out_folder():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == [b.name for b in BENCHMARKS]
    assert {c.dest: c.help for c in sub._choices_actions} == {b.name: b.help for b in BENCHMARKS}
    for name, parser in sub.choices.items():
        assert parser.parse_args([]).out is None, name


@pytest.mark.parametrize("name, argv, says", [
    ("gateway", ["--rounds", "0"], "need --rounds >= 1, --duration > 0"),
    ("gateway", ["--concurrency", "1,x"], "--concurrency and --streams: use numbers separated by commas"),
    ("speech", ["--users", "one"], "--users: use numbers separated by commas"),
    ("soak", ["--duration", "20", "--window", "10"], "--duration >= 3 windows"),
    ("cache", ["--repeats", "1.5"], "--repeats within 0..1"),
    ("affinity", ["--turns", "1"], "--turns >= 2"),
    ("llm", ["--max-tokens", "1"], "--max-tokens >= 2"),
])
def test_arguments_that_cannot_run_are_refused_before_anything_starts(monkeypatch, capsys, name, argv, says):
    record_calls(monkeypatch, name)
    assert cli.main([name, *argv]) == 2  # the stand-in run raises: it was not called
    err = capsys.readouterr().err
    assert err.startswith("rtxserve bench: error: ") and says in err


def test_a_refusal_names_the_options_to_fix(monkeypatch, capsys):
    record_calls(monkeypatch, "gateway")
    assert cli.main(["gateway", "--rounds", "0"]) == 2
    err = capsys.readouterr().err
    assert err == ("rtxserve bench: error: need --rounds >= 1, --duration > 0, --workers >= 1, --stream-prompts >= 1, "
                   "--profile-seconds >= 0 and levels >= 1\n")


def test_the_parsed_arguments_reach_the_benchmarks_own_run(monkeypatch):
    for name in ("gateway", "accuracy", "llm", "export"):
        record_calls(monkeypatch, name)
    args, kwargs = called("gateway", ["--concurrency", "2,4", "--streams", ""])
    assert args == (Path("unused"),) and kwargs["concurrency"] == (2, 4) and kwargs["streams"] == ()
    _, kwargs = called("accuracy", ["--url", "http://127.0.0.1:1/", "--model", "m"])
    assert kwargs["url"] == "http://127.0.0.1:1" and kwargs["model_dir"] == Path("m")
    (opts,), _ = called("llm", ["--gpu", "--skip-b4", "--bandwidth-gbs", "100"])
    assert opts.gpu and opts.skip == {"B4"} and opts.bandwidth_gbs == 100.0 and opts.out == Path("unused")
    args, kwargs = called("export", ["--seq", "64"])
    assert args == (None, Path("unused")) and kwargs["seq"] == 64 and kwargs["threads"] is None


def test_main_prints_the_page_and_lists_the_files_the_run_saved(monkeypatch, tmp_path, capsys):
    def run(args, out, progress):
        out.mkdir()
        for name in (files.json, files.page):  # no plot: a run that leaves one out is not said to have saved it
            (out / name).write_text("{}")
        return {"rounds": args.rounds}

    files = BY_NAME["batching"].files
    fake = dataclasses.replace(BY_NAME["batching"], run=run,
                               markdown=lambda result: f"# page of {result['rounds']} rounds")
    monkeypatch.setitem(cli.BY_NAME, "batching", fake)
    assert cli.main(["batching", "--rounds", "2", "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out == (f"# page of 2 rounds\nsaved: {tmp_path / 'b' / 'bench-batching.json'}, "
                                       f"{tmp_path / 'b' / 'bench-batching.md'}\n")


def test_a_failed_run_is_an_error_not_a_traceback(monkeypatch, capsys):
    def run(args, out, progress):
        raise RuntimeError("no nginx on this machine")

    monkeypatch.setitem(cli.BY_NAME, "gateway", dataclasses.replace(BY_NAME["gateway"], run=run))
    assert cli.main(["gateway", "--out", "unused"]) == 2
    assert capsys.readouterr().err == "rtxserve bench: error: no nginx on this machine\n"


def test_records_refuse_names_and_ids_the_reports_cannot_use():
    record = BY_NAME["cache"]
    with pytest.raises(ValueError, match="the name is lower-case letters"):
        dataclasses.replace(record, name="Cache")
    with pytest.raises(ValueError, match="BENCH.md's"):
        dataclasses.replace(record, id="B-9")
    with pytest.raises(ValueError, match="NAME.json"):
        Files("bench-cache.md", "bench-cache.json")
    assert isinstance(record, Benchmark) and record.section == "B9 answer caches"


def test_make_bench_puts_each_page_it_runs_under_its_section(monkeypatch, tmp_path):
    """B9 run now (its page and plot land in BENCHMARKS.md, the plot copied into bench/figures/), the others neither
    run now nor before (not run yet), R18's soak not taken at all."""
    ran = []

    def fake_bench(argv):
        name, folder = argv[0], Path(argv[2])
        ran.append(name)
        folder.mkdir(parents=True)
        files = BY_NAME[name].files
        (folder / files.page).write_text(f"# {name}'s page\n\n![the plot]({files.plots[0]})\n")
        (folder / files.plots[0]).write_bytes(b"png")
        return 0

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(make_bench, "bench", fake_bench)
    monkeypatch.setattr(make_bench, "machine", lambda: "EPYC; avx2")  # platform.processor() runs uname
    page = make_bench.run(tmp_path / "out", only=["B9"], log=lambda m: None).read_text()
    assert ran == ["cache"]
    sections = [line.removeprefix("## ") for line in page.splitlines() if line.startswith("## ")]
    assert sections == [b.section for b in BENCHMARKS if b.in_make_bench]
    assert "R18 bounded soak of the gateway" not in sections
    cache = page.split("## B9 answer caches\n", 1)[1].split("\n## ", 1)[0]
    assert "`rtxserve bench cache --out " in cache and "### cache's page" in cache
    assert "![the plot](bench/figures/cache-b9.png)" in cache and (tmp_path / "bench/figures/cache-b9.png").exists()
    assert page.count("not run yet.") == len(sections) - 1
    assert json.loads((tmp_path / "out" / "timings.json").read_text())["B9 answer caches"]["exit"] == 0


def test_make_bench_runs_the_benchmark_an_id_names_and_not_those_whose_id_starts_with_it(monkeypatch, tmp_path):
    ran = []

    def fake_bench(argv):
        ran.append(argv[0])
        return 1

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(make_bench, "bench", fake_bench)
    monkeypatch.setattr(make_bench, "machine", lambda: "EPYC; avx2")
    make_bench.run(tmp_path / "out", only=["B1"], log=lambda m: None)  # not B10, B11, ... B14
    assert ran == ["gateway"]
    make_bench.run(tmp_path / "out", only=["B5", "replay"], log=lambda m: None)  # "B3 / B5", and a sub-command
    assert ran == ["gateway", "batching", "replay"]


def test_make_bench_takes_help_and_refuses_a_name_it_has_not_before_running_anything(monkeypatch, tmp_path, capsys):
    """`python -m bench.all --help` once made a folder named --help and ran every benchmark."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(make_bench, "bench", lambda argv: pytest.fail("a benchmark ran"))
    with pytest.raises(SystemExit) as exit_:
        make_bench.main(["--help"])
    assert exit_.value.code == 0 and "B10" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        make_bench.main(["reports/bench", "B99"])
    assert exit_.value.code == 2 and "no benchmark is B99" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

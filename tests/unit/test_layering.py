"""The floors of the house (pyproject.toml's [tool.importlinter]): core/ imports nothing of ours; export/, serve/
and loadtest/ import only core/; deploy/ may import them; rtxserve/ and bench/ are the roof. Inside a package no two
modules or folders import each other, round any circle (import-linter's acyclic_siblings, which prints the imports
that would break it), and the gateway's API folders do not import one another. import-linter reads
every import, those inside functions too (its use case, not its CLI entry, which reconfigures the process's logging
and silences every logger made before it). On a back-import the test fails with import-linter's chains and the
package graph as it is."""

from pathlib import Path

import grimp
from importlinter import configuration
from importlinter.application.use_cases import lint_imports

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "export", "serve", "loadtest", "deploy", "fixture_models", "rtxserve", "bench")


def package_graph() -> str:
    """Which top-level package imports which: one line per package."""
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    lines = []
    for importer in PACKAGES:
        imported = [p for p in PACKAGES if p != importer
                    and graph.find_matching_direct_imports(import_expression=f"{importer}.** -> {p}.**")]
        lines.append(f"{importer:>9} -> {', '.join(imported) or '(nothing of ours)'}")
    return "\n".join(lines)


def test_no_package_imports_a_floor_above_its_own(capsys):
    configuration.configure()  # what the CLI module does on import: the readers of pyproject.toml and the graph builder
    kept = lint_imports(config_filename=str(REPO / "pyproject.toml"), cache_dir=None, no_logo=True)
    report = capsys.readouterr().out
    assert kept, f"{report}\npackage graph:\n{package_graph()}"

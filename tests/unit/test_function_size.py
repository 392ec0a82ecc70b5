"""No function in any package of ours (core/, export/, serve/, loadtest/, deploy/, fixture_models/, rtxserve/,
bench/) runs over 70 lines or takes over 10 parameters: past that, a function is several steps that want names of
their own (and an options dataclass instead of a dozen keywords)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES, MAX_PARAMS = 70, 10
PACKAGES = ("core", "export", "serve", "loadtest", "deploy", "fixture_models", "rtxserve", "bench")


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return len([n for n in names if n.arg not in ("self", "cls")])


def oversized(root: Path = REPO) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines, params = node.end_lineno - node.lineno + 1, parameters(node)
                    if lines > MAX_LINES or params > MAX_PARAMS:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines, {params} parameters")
    return found


def test_no_function_is_over_70_lines_or_10_parameters():
    assert oversized() == []


def test_the_count_sees_a_long_function(tmp_path):
    long = "def f(a, b, c, d, e, f, g, h, i, j, k):\n" + "    x = 1\n" * 90
    package = tmp_path / "export"
    package.mkdir()
    (package / "m.py").write_text(long)
    assert oversized(tmp_path) == ["export/m.py:1 f: 91 lines, 11 parameters"]

"""The reference pages, written from the code at every `mkdocs build` (mkdocs-gen-files runs this script), so
that they cannot drift from it and are never committed:

- reference/cli.md: every `rtxserve` command's usage and options, from the argparse parsers themselves;
- reference/gateway-settings.md: every field of `serve/gateway/settings.py: GatewaySettings`;
- reference/deployment-file.md: every field of the deployment file's models in `deploy/spec.py`;
- reference/metrics.md: the gateway's Prometheus metrics, named once in `core/metric_names.py`;
- reference/deploy-examples.md and reference/model-repository.md: the annotated example deployments and the
  repository layout, as the repository holds them;
- benchmarks/results.md: BENCHMARKS.md as `make bench` last wrote it, with its figures;
- benchmarks/index.md: the page as written, its table of benchmarks filled from bench/registry.py;
- design.md: the page as written, its package map filled from each package's own docstring.

The CLI page and the Markdown helpers are in docs/gen_cli.py.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import sys
import tokenize
import types
import typing
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "docs")]
# Defaults that read the environment (RTXSERVE_KEYS_FILE, RTXSERVE_ENVS_DIR, ...) show the code's own, not this
# machine's.
for _name in [n for n in os.environ if n.startswith("RTXSERVE_")]:
    del os.environ[_name]
os.environ["COLUMNS"] = "110"  # argparse wraps usage lines to the terminal: the same width on every machine

from gen_cli import GENERATED, cell, cli_page, code, prose, shown_path  # noqa: E402 (docs/, on the path above)


# --- pydantic models ------------------------------------------------------------------------------------------


def type_name(annotation) -> str:
    """A field's type as a reader writes it in YAML terms: int, str | null, list[str], "auto" | int, ..."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if annotation is type(None):
        return "null"
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return "mapping"
    if isinstance(annotation, type):
        return {"Path": "path"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def constraints(field) -> str:
    names = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "at least", "max_length": "at most"}
    found = []
    for meta in field.metadata:
        for attr, sign in names.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def default_of(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if hasattr(value, "model_dump"):
        return "see below"
    value = shown_path(value)
    if value == "":
        return '`""`'
    if isinstance(value, (dict, list, tuple)) and not value:
        return code("{}" if isinstance(value, dict) else "[]")
    if isinstance(value, (dict, list)):
        return code(json.dumps(value, default=str))
    return code("null" if value is None else str(value).lower() if isinstance(value, bool) else value)


def field_rows(model, env_prefix: str | None = None) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        what = [field.description or ""]
        if constraints(field):
            what.append(f"({constraints(field)})")
        first = code(name) + (f"<br>`{env_prefix}{name.upper()}`" if env_prefix else "")
        rows.append(f"| {first} | {code(type_name(field.annotation))} | {default_of(field)} | {cell(' '.join(w for w in what if w))} |")
    return rows


def settings_page() -> str:
    from serve.gateway.settings import Alias, GatewaySettings

    prefix = GatewaySettings.model_config.get("env_prefix", "")
    out = io.StringIO()
    out.write("# Gateway settings\n\n" + GENERATED.format(source="serve/gateway/settings.py: GatewaySettings"))
    out.write(f"{prose(inspect.getdoc(GatewaySettings))}\n\n")
    out.write(f"Every field is read from the environment as `{prefix}<FIELD>` (upper case) or from the YAML file that "
              "`RTXSERVE_CONFIG` names; the `rtxserve serve gateway` flags override both, and a deployment file's "
              "`gateway.settings` takes them by their lower-case names ([deployment file](deployment-file.md)). "
              "Unknown fields are refused. Mappings and lists are given as JSON in the environment, e.g. "
              f"`{prefix}MODEL_CONCURRENCY='{{\"llm\": 32}}'`.\n\n")
    out.write("| setting | type | default | what |\n|---|---|---|---|\n")
    out.write("\n".join(field_rows(GatewaySettings, prefix)) + "\n\n")
    out.write(f"## An alias\n\n{prose(inspect.getdoc(Alias))} A value of `aliases` is either this object or its `targets` "
              "mapping alone.\n\n| field | type | default | what |\n|---|---|---|---|\n")
    out.write("\n".join(field_rows(Alias)) + "\n")
    return out.getvalue()


def speech_refuses(spec) -> str:
    """What SpeechModel's own check says when every field an LLM takes is given: the options it refuses, and why."""
    check = spec.SpeechModel.__pydantic_decorators__.model_validators["_no_chat_options"].func
    try:
        check(types.SimpleNamespace(**{name: "set" for name in spec.LLMModel.model_fields}))
    except ValueError as exc:
        return str(exc)
    raise RuntimeError("SpeechModel refuses nothing: say what it takes in docs/gen_reference.py")


def deployment_page() -> str:
    from deploy import spec

    out = io.StringIO()
    out.write("# The deployment file\n\n" + GENERATED.format(source="the pydantic models of deploy/spec.py"))
    doc = inspect.getdoc(spec)
    title, _, rest = doc.partition("\n\n")
    example, _, after = rest.partition("\n\n")
    out.write(f"{prose(title)}\n\n```yaml\n{inspect.cleandoc(example)}\n```\n\n{prose(after)}\n\n")
    out.write("Annotated examples: [deploy examples](deploy-examples.md). How a file is planned, served and rendered: "
              "[Deploy](../deploy/index.md).\n\n")
    sections = [
        ("Top level", spec.Deployment, ""),
        ("`gpus`", spec.GPUs, ""),
        ("`ports`", spec.Ports, ""),
        ("`gateway`", spec.Gateway, "`settings` takes any [gateway setting](gateway-settings.md) but those the "
                                    f"deployment itself decides: {', '.join(f'`{n}`' for n in sorted(spec._WIRED))}."),
        ("`kubernetes`", spec.Kubernetes, ""),
    ]
    for kind in typing.get_args(typing.get_args(spec.Model)[0]):
        (tag,) = typing.get_args(kind.model_fields["kind"].annotation)
        note = f"Refused here: {speech_refuses(spec)}." if kind is spec.SpeechModel else ""
        sections.append((f"`models[]` with `kind: {tag}`", kind, note))
    for title, model, note in sections:
        out.write(f"## {title}\n\n")
        doc = model.__doc__ and inspect.getdoc(model)
        if doc and model.__doc__ is not spec._Strict.__doc__:
            out.write(prose(doc) + "\n\n")
        if note:
            out.write(note + "\n\n")
        out.write("| field | type | default | what |\n|---|---|---|---|\n" + "\n".join(field_rows(model)) + "\n\n")
    return out.getvalue()


# --- metrics --------------------------------------------------------------------------------------------------


def metric_comments(path: Path) -> dict[str, str]:
    """NAME -> the comment on its line, or the comment lines just above it, in core/metric_names.py."""
    out, above, pending = {}, [], None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if pending and tok.start[0] == pending[1]:
                out[pending[0]] = text
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 0 and tok.string.isupper():
            pending = (tok.string, tok.start[0])
            if above:
                out[tok.string] = " ".join(above)
            above = []
        elif tok.type == tokenize.NL and tok.start[1] == 0 and not tok.line.strip():
            above = []
    return out


def metrics_page() -> str:
    from core import metric_names
    from serve.gateway import metrics as exported

    comments = metric_comments(ROOT / "core" / "metric_names.py")
    collectors = {getattr(exported, n)._name: getattr(exported, n) for n in dir(exported)
                  if hasattr(getattr(exported, n), "describe") and hasattr(getattr(exported, n), "_name")}
    out = io.StringIO()
    out.write("# Metrics\n\n" + GENERATED.format(source="core/metric_names.py and serve/gateway/metrics.py"))
    out.write(f"{prose(inspect.getdoc(metric_names))}\n\n")
    out.write("The gateway serves them on `GET /metrics`; with several workers, `PROMETHEUS_MULTIPROC_DIR` makes "
              "`/metrics` aggregate all of them. Triton's (`:8002/metrics`) and vLLM's (`/metrics`) own metrics are "
              "theirs, unchanged.\n\n")
    out.write("| metric | type | labels | what | note |\n|---|---|---|---|---|\n")
    headers = []
    for const, name in vars(metric_names).items():
        if not const.isupper() or not isinstance(name, str):
            continue
        if not name.startswith("rtxserve_"):
            headers.append((const, name))
            continue
        collector = collectors.get(name.removesuffix("_total"))
        kind, labels, help_ = "", "", ""
        if collector is not None:
            (family,) = collector.describe()
            kind, help_ = family.type, family.documentation
            labels = ", ".join(f"`{label}`" for label in getattr(collector, "_labelnames", ()))
        note = re.sub(r"^(histogram|counter|gauge)(, by [^:]*)?:?\s*", "", comments.get(const, ""))
        out.write(f"| `{name}` | {kind} | {labels} | {cell(help_)} | {cell(note)} |\n")
    if headers:
        out.write("\n## Response headers\n\n| header | what |\n|---|---|\n")
        out.write("".join(f"| `{name}` | {cell(comments.get(const, ''))} |\n" for const, name in headers))
    return out.getvalue()


# --- files the repository holds ---------------------------------------------------------------------------------


def examples_page() -> str:
    out = io.StringIO()
    out.write("# Deploy examples\n\n" + GENERATED.format(source="deploy/examples/"))
    out.write("The annotated example deployments in `deploy/examples/`, as the repository holds them. Each is loaded, "
              "planned and rendered by the tests (`tests/unit/test_deploy_examples.py`); every field is in "
              "[the deployment file](deployment-file.md).\n\n")
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        out.write(f"## {path.name}\n\n```yaml\n{path.read_text().rstrip()}\n```\n\n")
    return out.getvalue()


def model_repository_page() -> str:
    text = (ROOT / "model_repository" / "README.md").read_text()
    title, _, body = text.partition("\n")
    return f"{title}\n\n" + GENERATED.format(source="model_repository/README.md") + body.lstrip("\n")


def benchmark_results() -> str:
    """BENCHMARKS.md with its figures beside it; its title becomes the page's."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    for figure in sorted(set(re.findall(r"\]\(bench/figures/([^)]+)\)", text))):
        with mkdocs_gen_files.open(f"benchmarks/figures/{figure}", "wb") as f:
            f.write((ROOT / "bench" / "figures" / figure).read_bytes())
    text = text.replace("](bench/figures/", "](figures/")
    # Below a benchmark's own heading, BENCHMARKS.md's headings are captions (the model, the machine, the rounds):
    # bold lines here, so that the page's contents list the benchmarks alone.
    text = re.sub(r"^#{3,} (.+)$", r"**\1**", text, flags=re.MULTILINE)
    title, _, body = text.partition("\n")
    return (title.replace("# Benchmarks", "# Benchmark results") + "\n\n"
            + GENERATED.format(source="BENCHMARKS.md, which `make bench` writes") + body.lstrip("\n"))


TABLE = "<!-- the benchmark table, written here by docs/gen_reference.py from bench/registry.py -->"


def benchmarks_index() -> str:
    """docs/benchmarks/index.md with every benchmark of the registry in its table: id and title, what it measures
    (its sub-command's help), its command, whether `make bench` runs it, and its section of the results."""
    from markdown.extensions.toc import slugify

    from bench.registry import BENCHMARKS

    page = (ROOT / "docs" / "benchmarks" / "index.md").read_text()
    if TABLE not in page:
        raise ValueError(f"docs/benchmarks/index.md lost the line {TABLE}")
    rows = ["| benchmark | what it measures | command | in `make bench` | results |", "|---|---|---|---|---|"]
    rows += [f"| {b.id}: {cell(b.title)} | {cell(b.help)} | `rtxserve bench {b.name}` | "
             + (f"yes | [{b.id}](results.md#{slugify(b.section, '-')}) |" if b.in_make_bench else "no: on demand | – |")
             for b in BENCHMARKS]
    return page.replace(TABLE, "\n".join(rows))


MAP = "<!-- the package map, written here by docs/gen_reference.py from each package's own docstring -->"
MAP_ROOTS = ("core", "export", "serve", "loadtest", "deploy", "rtxserve", "bench", "fixture_models")  # ground floor first


def design_page() -> str:
    """docs/design.md with its package map: every package and room (three folders deep at most, migrations left out),
    its lines of Python and the first paragraph of its own docstring ("–" where it has none)."""
    import ast

    page = (ROOT / "docs" / "design.md").read_text()
    if MAP not in page:
        raise ValueError(f"docs/design.md lost the line {MAP}")
    rows = ["| package | lines | what it holds (its docstring) |", "|---|---|---|"]
    for root in MAP_ROOTS:
        for init in sorted((ROOT / root).rglob("__init__.py")):
            folder = init.parent.relative_to(ROOT)
            if len(folder.parts) > 3 or "migrations" in folder.parts:
                continue
            doc = (ast.get_docstring(ast.parse(init.read_text())) or "").split("\n\n")[0]
            lines = sum(len(p.read_text().splitlines()) for p in (ROOT / folder).rglob("*.py"))
            rows.append(f"| `{folder.as_posix()}/` | {lines:,} | {cell(doc) if doc else '–'} |")
    return page.replace(MAP, "\n".join(rows))


PAGES = {
    "reference/cli.md": cli_page,
    "reference/gateway-settings.md": settings_page,
    "reference/deployment-file.md": deployment_page,
    "reference/metrics.md": metrics_page,
    "reference/deploy-examples.md": examples_page,
    "reference/model-repository.md": model_repository_page,
    "benchmarks/results.md": benchmark_results,
    "benchmarks/index.md": benchmarks_index,
    "design.md": design_page,
}

for page, write in PAGES.items():
    text = write()
    with mkdocs_gen_files.open(page, "w") as f:
        f.write(text)

"""MkDocs hooks (mkdocs.yml: hooks): what the pages need so that they read the same on the site as on GitHub.

A pipe inside inline code in a table row is written `\\|`, as GitHub's tables need it; Python-Markdown's tables
already leave pipes inside code alone, and would show the backslash. It is taken out here, in table rows only.
"""

from __future__ import annotations

import re

CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _unescape(match: re.Match) -> str:
    return match.group(1) + match.group(2).replace("\\|", "|") + match.group(1)


def on_page_markdown(markdown: str, **_) -> str:
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if not fenced and line.startswith("|") and "\\|" in line:
            line = CODE_SPAN.sub(_unescape, line)
        lines.append(line)
    return "\n".join(lines)

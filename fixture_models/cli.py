"""`rtxserve fixtures`: argument parsing only; the fixtures are in their family's module."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from export.exceptions import ExportError

    from . import FIXTURES, write_fixtures
    from .training import FixtureError

    parser = argparse.ArgumentParser(prog="rtxserve fixtures", description="Write small fine-tuned-style checkpoints.")
    parser.add_argument("names", nargs="*", help=f"which (default: all): {', '.join(FIXTURES)}")
    parser.add_argument("--out", type=Path, default=Path(".rtxserve/fixtures"), help="folder (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        written = write_fixtures(args.out, args.names or None)
    except (ValueError, OSError, FixtureError, ExportError) as exc:  # ExportError: the YOLO environment is missing
        print(f"rtxserve fixtures: error: {exc}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0

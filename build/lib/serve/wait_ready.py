"""`python -m serve.wait_ready URL [--timeout S]`: wait until URL answers 200 (exit 0) or the time is up
(exit 1). The systemd units' ExecStartPost: a unit counts as started once its server is ready, so the
units after it (the gateway after its engines) start against live backends."""

from __future__ import annotations

import argparse
import sys

import httpx
import tenacity


def wait_ready(url: str, timeout_s: float) -> bool:
    @tenacity.retry(stop=tenacity.stop_after_delay(timeout_s), wait=tenacity.wait_fixed(1),
                    retry=tenacity.retry_if_result(lambda ok: not ok) | tenacity.retry_if_exception_type(httpx.HTTPError),
                    retry_error_callback=lambda state: False)
    def ready() -> bool:
        return httpx.get(url, timeout=2.0).status_code == 200

    return ready()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.wait_ready", description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default %(default)s)")
    args = parser.parse_args(argv)
    if wait_ready(args.url, args.timeout):
        return 0
    print(f"{args.url} was not ready after {args.timeout:g}s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

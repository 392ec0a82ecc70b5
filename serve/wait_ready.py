"""`python -m serve.wait_ready URL [--timeout S] [--then-sleep LEVEL]`: wait until URL answers 200 (exit 0) or the
time is up (exit 1). The systemd units' ExecStartPost: a unit counts as started once its server is ready, so the
units after it (the gateway after its engines) start against live backends.

`--then-sleep`: then put the vLLM engine at URL's host to sleep (its POST /sleep?level=LEVEL, with
--enable-sleep-mode): an on-demand engine on a GPU starts awake (vLLM has no way to start asleep), takes its share,
and sleeps before the next engine on its card starts; the gateway wakes it on its first request."""

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
    parser.add_argument("--then-sleep", type=int, choices=(1, 2), help="then POST /sleep?level=LEVEL to its host")
    args = parser.parse_args(argv)
    if not wait_ready(args.url, args.timeout):
        print(f"{args.url} was not ready after {args.timeout:g}s", file=sys.stderr)
        return 1
    if args.then_sleep is not None:
        base = httpx.URL(args.url).copy_with(path="/", query=None)
        answer = httpx.post(base.join(f"/sleep?level={args.then_sleep}"), timeout=args.timeout)
        if answer.status_code != 200:
            print(f"{base} did not go to sleep: HTTP {answer.status_code} {answer.text[:300]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

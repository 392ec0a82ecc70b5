"""`python -m serve.wait_ready URL [--timeout S] [--then-sleep LEVEL]`: wait until URL answers 200 (exit 0) or the
time is up (exit 1). The systemd units' ExecStartPost: a unit counts as started once its server is ready, so the
units after it (the gateway after its engines) start against live backends.

`--then-sleep`: then put the vLLM engine at URL's host to sleep (its POST /sleep?level=LEVEL&mode=wait, with
--enable-sleep-mode): an on-demand engine on a GPU starts awake (vLLM has no way to start asleep), takes its share,
and sleeps before the next engine on its card starts; the gateway wakes it on its first request. An engine already
asleep, or one that has answered requests (the gateway woke it: a later `docker compose up -d` runs the one-shots
again), is left as it is."""

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
        try:
            why_not = _awake_for_a_reason(base)
        except (httpx.HTTPError, ValueError) as exc:
            print(f"{base} did not say whether it sleeps or has served: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        if why_not:
            print(f"{base} left as it is: {why_not}")
            return 0
        answer = httpx.post(base.join(f"/sleep?level={args.then_sleep}&mode=wait"), timeout=args.timeout)
        if answer.status_code != 200:
            print(f"{base} did not go to sleep: HTTP {answer.status_code} {answer.text[:300]}", file=sys.stderr)
            return 1
    return 0


def _awake_for_a_reason(base: httpx.URL) -> str:
    """Why the engine must not be put to sleep now ('' where it must): it sleeps already, or it has answered
    requests (vLLM's vllm:request_success_total), so the gateway woke it and may be streaming from it."""
    from prometheus_client.parser import text_string_to_metric_families

    if httpx.get(base.join("/is_sleeping"), timeout=10).raise_for_status().json().get("is_sleeping"):
        return "it is asleep already"
    metrics = httpx.get(base.join("/metrics"), timeout=10).raise_for_status().text
    served = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == "vllm:request_success_total")
    return f"it has answered {served:g} requests (the gateway woke it)" if served else ""


if __name__ == "__main__":
    sys.exit(main())

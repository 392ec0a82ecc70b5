"""Raw per-request samples for every scenario: one CSV row per request, written by each locust process.

Locust's own percentiles come from rounded buckets; reports are computed from these rows instead.
Columns: end time (epoch s), request name, latency (ms), ok (1/0), error (truncated message); then, only
for requests whose context carries streaming figures (successful streamed ones): time to first token
(ms, empty if no text came), output tokens, inter-token gaps (ms, space-separated).
"""

import csv
import os
import time

from locust import events

_file = None
_writer = None


@events.init.add_listener
def _open(environment, **_kwargs):
    global _file, _writer
    path = os.environ.get("RTXSERVE_SAMPLES")
    if path:
        _file = open(f"{path}.{os.getpid()}", "w", newline="", buffering=1)
        _writer = csv.writer(_file)


@events.request.add_listener
def _record(name, response_time, exception=None, context=None, **_kwargs):
    if _writer is not None:
        error = "" if exception is None else str(exception).replace("\n", " ")[:160]
        row = [f"{time.time():.6f}", name, f"{response_time:.3f}", 0 if exception else 1, error]
        if context and "output_tokens" in context:
            ttft = context["ttft_ms"]
            row += ["" if ttft is None else f"{ttft:.3f}", context["output_tokens"],
                    " ".join(f"{gap:.3f}" for gap in context["itl_ms"])]
        _writer.writerow(row)


@events.quit.add_listener
def _close(**_kwargs):
    if _file is not None:
        _file.close()

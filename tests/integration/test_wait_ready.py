"""`python -m serve.wait_ready`, over a real socket: what the systemd units, the compose one-shots and the Kubernetes
init containers run."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serve.wait_ready import main


def _engine(calls: list, sleeping: bool, served: int) -> ThreadingHTTPServer:
    """A stand-in for vLLM's routes that wait_ready reads: /health (ready at the second look), /is_sleeping, /metrics
    (vllm:request_success_total as vLLM writes it) and POST /sleep."""
    class Engine(BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(("GET", self.path))
            bodies = {"/is_sleeping": b'{"is_sleeping": %s}' % (b"true" if sleeping else b"false"),
                      "/metrics": b'# TYPE vllm:request_success counter\n'
                                  b'vllm:request_success_total{finished_reason="stop",model_name="m"} %d.0\n' % served}
            ready = self.path != "/health" or sum(c == ("GET", "/health") for c in calls) > 1
            self.send_response(200 if ready else 503)
            self.end_headers()
            self.wfile.write(bodies.get(self.path, b""))

        def do_POST(self):
            calls.append(("POST", self.path))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("sleeping, served, slept", [(False, 0, True), (True, 0, False), (False, 3, False)])
def test_then_sleep_puts_a_fresh_engine_to_sleep_and_leaves_one_asleep_or_serving(sleeping, served, slept):
    """An on-demand GPU engine starts awake and is put to sleep (waiting for what it runs) before the next engine on
    its card starts; run again (a later `docker compose up -d`), the one-shot leaves an engine asleep, or one the
    gateway woke and that has answered requests, as it is."""
    calls = []
    server = _engine(calls, sleeping, served)
    try:
        assert main([f"http://127.0.0.1:{server.server_address[1]}/health", "--timeout", "10", "--then-sleep", "1"]) == 0
    finally:
        server.shutdown()
    assert calls[:3] == [("GET", "/health"), ("GET", "/health"), ("GET", "/is_sleeping")]
    assert (("POST", "/sleep?level=1&mode=wait") in calls) == slept and sum(c[0] == "POST" for c in calls) == int(slept)

"""`python -m serve.wait_ready`, over a real socket: what the systemd units, the compose one-shots and the Kubernetes
init containers run."""


def test_wait_ready_then_sleep_waits_for_the_engine_then_puts_it_to_sleep():
    """An on-demand GPU engine starts awake and is put to sleep before the next engine on its card starts."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from serve.wait_ready import main

    calls = []

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(("GET", self.path))
            self.send_response(200 if len(calls) > 1 else 503)  # ready at the second look
            self.end_headers()

        def do_POST(self):
            calls.append(("POST", self.path))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        assert main([url, "--timeout", "10", "--then-sleep", "1"]) == 0
    finally:
        server.shutdown()
    assert calls == [("GET", "/health"), ("GET", "/health"), ("POST", "/sleep?level=1")]

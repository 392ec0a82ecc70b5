"""The scraper against a real HTTP /metrics endpoint (and a dead and a refusing one), and GPU rows from an
nvidia-smi on PATH: a socket and a process, so here and not in the unit tier (tests/unit/test_server_metrics.py
holds the parsing and the derived series)."""

import socket
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from loadtest import server_metrics as sm
from loadtest.server_metrics import Scraper, derive, load
from tests.unit.test_server_metrics import triton_text


class _Metrics(BaseHTTPRequestHandler):
    seen_auth: list = []

    def do_GET(self):
        if self.path == "/denied":
            return self.send_error(401)
        _Metrics.seen_auth.append(self.headers.get("Authorization"))
        body = triton_text(len(_Metrics.seen_auth), 0, 0, (0, 0, 0), 0, 0).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_scraper_writes_kept_samples_and_records_a_refusing_target_without_stopping(tmp_path, monkeypatch):
    monkeypatch.setattr(sm, "_gpu_reader", lambda: None)  # the same rows on machines with and without a GPU
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/metrics"
    good = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    denied = good.replace("/metrics", "/denied")
    try:
        scraper = Scraper([dead, good, denied], tmp_path / "server.csv", interval_s=0.1,
                          headers={"Authorization": "Bearer x"})
        scraper.start()
        deadline = time.monotonic() + 30
        while (scraper.scrapes.get(good, 0) < 3 or len(scraper.errors) < 2) and time.monotonic() < deadline:
            time.sleep(0.02)  # polled: the first scrape at once, then one each interval
        scraper.stop()
    finally:
        server.shutdown()
    assert set(scraper.errors) == {dead, denied}
    assert scraper.errors[dead].startswith("ConnectError:")
    assert scraper.errors[denied] == "HTTPStatusError: Client error '401 Unauthorized' for url '%s'" % denied
    assert scraper.scrapes[good] >= 3
    assert set(_Metrics.seen_auth) == {"Bearer x"}
    samples = load(tmp_path / "server.csv")
    assert {r.target for r in samples} == {good}
    assert {r.metric for r in samples} <= sm.KEEP and "nv_cpu_utilization" not in {r.metric for r in samples}
    assert samples[0].metric == "nv_inference_request_success"  # as Triton names it, without "_total"
    assert samples[0].labels == {"model": "reviews", "version": "1"}
    series = derive(samples, samples[0].time)
    assert np.nanmax(series["triton reviews_model requests/s"].y) > 0


def test_gpu_rows_come_from_nvidia_smi_without_pynvml_and_nothing_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '0, 37, 1024\\n1, [N/A], 2048\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    stamp, samples = sm._gpu_reader()()
    assert samples == [("gpu_utilization_percent", {"gpu": "0"}, 37.0),
                       ("gpu_memory_used_bytes", {"gpu": "0"}, 1024 * 2**20),
                       ("gpu_memory_used_bytes", {"gpu": "1"}, 2048 * 2**20)]  # N/A is left out
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert sm._gpu_reader() is None

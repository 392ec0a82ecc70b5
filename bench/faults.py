"""The fault half of `rtxserve bench reliability` (bench/reliability.py runs it, judges it and writes the page): a
hung and a killed backend (R2, R1), oversized requests (R5) and a dead model behind a server that still calls it ready
(R11), each against the real tritonserver and gateway."""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from .gateway import MODEL, TEXT, classifier_stack, export_classifier

DEADLINE_S = 1.5
R2_PROBE_P99_MAX_MS = 100.0
R1_REFUSAL_P99_MAX_MS = 200.0
R5_REFUSAL_P99_MAX_MS = 100.0
R5_BODY_CAP = 1 << 20
R5_REPEATS = 25
R11_INTERVAL_S = 1.5  # Triton itself takes about 1 s to answer that a stub is not healthy
R11_MAX_INTERVALS = 2.0

def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _triton_pid(http_url: str) -> int:
    """The tritonserver listening on `http_url`'s port (the stack owns the process; the faults are signals to it)."""
    import psutil

    port = int(http_url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == "LISTEN")


def _timed_get(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    if client.get(url).status_code >= 500 and not url.endswith("/readyz"):
        raise RuntimeError(f"{url} failed while the backend was stopped: R2 is broken, not slow")
    return (time.perf_counter() - started) * 1000


def faults(*, rounds: int, progress) -> dict:
    """R5 once, R2 each round (hang, measure, wake), then R1 once (the kill ends the stack's Triton)."""
    import concurrent.futures as cf
    import os
    import signal

    env = {"RTXSERVE_REQUEST_TIMEOUT_S": str(DEADLINE_S), "RTXSERVE_HEALTH_INTERVAL_S": "0.5",
           "RTXSERVE_MAX_BODY_BYTES": str(R5_BODY_CAP)}
    body = {"model": MODEL, "input": TEXT}
    r2_rounds, refusals = [], []
    with classifier_stack(1, progress, gateway_env=env) as (url, triton_url, _), httpx.Client(timeout=30) as client:
        def classify() -> tuple[int, float]:
            started = time.perf_counter()
            code = client.post(f"{url}/v1/classify", json=body).status_code
            return code, (time.perf_counter() - started) * 1000

        pid = _triton_pid(triton_url)
        [classify() for _ in range(20)]  # warm
        refused = r5(url)
        progress(f"R5: {sum(map(len, refused.values()))} oversized requests refused, P99 "
                 f"{percentile(sum(refused.values(), []), 99):.1f} ms")
        for i in range(rounds):
            os.kill(pid, signal.SIGSTOP)
            try:
                with cf.ThreadPoolExecutor(3) as pool:
                    hung = [pool.submit(classify) for _ in range(3)]
                    probes = [_timed_get(client, f"{url}{path}") for _ in range(20)
                              for path in ("/healthz", "/metrics", "/readyz") if not all(f.done() for f in hung)]
                    answers = [f.result() for f in hung]
            finally:
                os.kill(pid, signal.SIGCONT)
            if {code for code, _ in answers} != {504}:
                raise RuntimeError(f"a hung backend's requests got {answers}, not 504s: R2 is broken, not slow")
            while classify()[0] != 200:
                time.sleep(0.1)
            r2_rounds.append({"probe_p99_ms": percentile(probes, 99), "probes": probes,
                              "answered_s": [ms / 1000 for _, ms in answers]})
            progress(f"R2 round {i + 1}/{rounds}: 504s at {', '.join(f'{ms / 1000:.2f}' for _, ms in answers)} s "
                     f"(deadline {DEADLINE_S:g} s), probes P99 {r2_rounds[-1]['probe_p99_ms']:.1f} ms")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() < killed + 1.5:  # the health loop marks the replica down
            classify()
        while len(refusals) < 200:
            code, ms = classify()
            if code != 503:
                raise RuntimeError(f"a request to a killed backend got {code}, not 503: R1 is broken, not slow")
            refusals.append(ms)
    progress(f"R1: {len(refusals)} refusals after the kill, P99 {percentile(refusals, 99):.1f} ms")
    answered = [s for r in r2_rounds for s in r["answered_s"]]
    return {"deadline_s": DEADLINE_S, "rounds": r2_rounds,
            "probe_p99_ms": statistics.median(r["probe_p99_ms"] for r in r2_rounds),
            "answered_min_s": min(answered), "answered_max_s": max(answered),
            "refusal_p50_ms": percentile(refusals, 50), "refusal_p99_ms": percentile(refusals, 99),
            "refusals": refusals,
            "oversized": refused, "oversized_p99_ms": percentile(sum(refused.values(), []), 99),
            "oversized_max_ms": {name: max(ms) for name, ms in refused.items()}}


def raw_status(url: str, data: bytes) -> int:
    """The status of one request sent as these bytes (socket.timeout where no answer comes within 10 s)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        return int(sock.recv(65536).split(b" ", 2)[1])


def oversized(auth: bytes = b"") -> dict[str, tuple[bytes, int]]:
    """R5's requests, against a body cap of R5_BODY_CAP: name -> (the bytes sent, the status that refuses them).
    `auth`: a header line the gateway's keys want."""
    post = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
    chunk = b"x" * 65536
    chunked = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * 20 + b"0\r\n\r\n"  # 1.3 MB over the cap
    deep = b'{"model": "%s", "input": ' % MODEL.encode() + b"[" * 3000 + b"]" * 3000 + b"}"
    return {"200 MB declared, none sent": (post + b"Content-Length: 200000000\r\n\r\n", 413),
            "1.3 MB chunked": (post + b"Transfer-Encoding: chunked\r\n\r\n" + chunked, 413),
            "100 kB header": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"X-Big: " + b"y" * 100_000
                              + b"\r\n\r\n", 431),
            "JSON 3,000 deep": (post + b"Content-Length: %d\r\n\r\n" % len(deep) + deep, 422)}


def r5(url: str) -> dict[str, list[float]]:
    """Each of R5's requests R5_REPEATS times: the ms until its refusal, by request."""
    times = {}
    for name, (data, status) in oversized().items():
        times[name] = []
        for _ in range(R5_REPEATS):
            started = time.perf_counter()
            got = raw_status(url, data)
            times[name].append((time.perf_counter() - started) * 1000)
            if got != status:
                raise RuntimeError(f"{name} got {got}, not {status}: R5 is broken, not slow")
    return times


def _kill_stubs(triton_pid: int) -> None:
    """Kill the Python backend stubs under this tritonserver (the classifier's tokenizer and postprocess): its model
    dies while the server still answers that the model is ready."""
    import psutil

    stubs = [p for p in psutil.Process(triton_pid).children(recursive=True)
             if "triton_python_backend_stub" in " ".join(p.cmdline())]
    if not stubs:
        raise RuntimeError("no Python stubs under the second tritonserver: R11 is broken, not slow")
    for stub in stubs:
        stub.kill()


def _backend_state(url: str, backend: str) -> str:
    return httpx.get(f"{url}/readyz", timeout=10).json()["backends"][backend]


def _until_state(url: str, backend: str, word: str, limit_s: float = 60) -> float:
    """Seconds until /readyz says `word` of `backend` (polled every 10 ms)."""
    started = time.monotonic()
    while word not in _backend_state(url, backend):
        if time.monotonic() > started + limit_s:
            raise RuntimeError(f"{backend} not {word!r} after {limit_s:g} s: R11 is broken, not slow")
        time.sleep(0.01)
    return time.monotonic() - started


def r11(*, rounds: int, progress) -> dict:
    """Each round: a second tritonserver beside the first behind a fresh gateway, its model's stubs killed; how long
    until the gateway says the replica is not ready."""
    from serve.stack import start_gateway, start_triton

    env, noticed = {"RTXSERVE_HEALTH_INTERVAL_S": str(R11_INTERVAL_S)}, []
    with tempfile.TemporaryDirectory(prefix="rtxserve-bench-") as tmp:
        work = Path(tmp)
        repo = export_classifier(work, progress)
        first, first_opts = start_triton(repo, work / "first")
        try:
            for i in range(rounds):
                second, opts = start_triton(repo, work / f"second-{i}")
                grpc = f"127.0.0.1:{first_opts.grpc_port},127.0.0.1:{opts.grpc_port}"
                try:
                    gateway, url = start_gateway(grpc, work / f"gateway-{i}", extra_env=env)
                    try:
                        backend = f"triton@127.0.0.1:{opts.grpc_port}"
                        _until_state(url, backend, "up")
                        _kill_stubs(second.process.pid)
                        noticed.append(_until_state(url, backend, "not ready"))
                    finally:
                        gateway.stop()
                finally:
                    second.stop()
                progress(f"R11 round {i + 1}/{rounds}: noticed {noticed[-1]:.2f} s after the stubs died "
                         f"(health interval {R11_INTERVAL_S:g} s)")
        finally:
            first.stop()
    return {"interval_s": R11_INTERVAL_S, "noticed_s": noticed, "noticed_max_intervals": max(noticed) / R11_INTERVAL_S}

"""Per-key quotas shared by a fleet: gateways on different ports (real processes, on the session's Triton) count one
key's requests in one real Redis (Debian's redis-server, started here), exactly; while Redis restarts they admit
uncounted (rate_limit_unavailable: open, the default) or refuse with 503 (closed), and counting resumes after."""

import shutil
import socket
import subprocess
import time

import httpx
import pytest

from serve.gateway.access.keys import ApiKey, hash_key, write_keys
from serve.launcher import free_port
from serve.stack import start_gateway

from .conftest import MODEL, revive_triton

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (`make setup-redis`)")
KEYS = {"team": ("rtx-team-secret", 10), "other": ("rtx-other-secret", 2)}


class Redis:
    def __init__(self, port: int, log):
        self.port, self.log, self.process = port, log, None

    def start(self) -> "Redis":
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline and self.process.poll() is None, "redis-server did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


@pytest.fixture(scope="module")
def fleet(stack, tmp_path_factory):
    """Redis, and three gateways counting in it: two that admit while it is gone, one that refuses."""
    revive_triton(stack)  # a module fixture: set up before the autouse check that a test left Triton alive
    work = tmp_path_factory.mktemp("fleet")
    write_keys(work / "keys.json", {n: ApiKey(name=n, hash=hash_key(s), rpm=rpm) for n, (s, rpm) in KEYS.items()})
    redis = Redis(free_port(), open(work / "redis.log", "w")).start()
    env = {"RTXSERVE_KEYS_FILE": str(work / "keys.json"),
           "RTXSERVE_RATE_LIMIT_STORAGE": f"async+redis://127.0.0.1:{redis.port}"}
    gateways = []
    try:
        for i, unavailable in enumerate(("open", "open", "closed")):
            gateways.append(start_gateway(stack.triton_grpc_url, work / f"gateway-{i}",
                                          extra_env={**env, "RTXSERVE_RATE_LIMIT_UNAVAILABLE": unavailable}))
        yield redis, [url for _, url in gateways]
    finally:
        for server, _ in gateways:
            server.stop()
        redis.stop()


def _classify(url: str, key: str) -> int:
    return httpx.post(f"{url}/v1/classify", json={"model": MODEL, "input": "good"}, timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[key][0]}"}).status_code


def test_a_keys_quota_is_exact_across_gateways_and_survives_a_redis_restart(fleet):
    redis, (one, two, closed) = fleet
    codes = [_classify(url, "team") for url in (one, two) * 8]  # 16 requests against 10 a minute, alternating
    assert codes.count(200) == 10 and codes.count(429) == 6 and codes[:10] == [200] * 10, codes
    redis.stop()
    try:
        assert [_classify(url, "other") for url in (one, two, one)] == [200, 200, 200]  # open: admitted uncounted
        assert _classify(closed, "other") == 503  # closed: refused while Redis is gone
        errors = httpx.get(f"{one}/metrics", timeout=10).text
        assert "rtxserve_quota_storage_errors_total 2.0" in errors  # two of the three went through gateway one
    finally:
        redis.start()
    # a fresh Redis (no persistence): counting starts again from zero, on every gateway
    assert [_classify(url, "other") for url in (one, two, closed)] == [200, 200, 429]

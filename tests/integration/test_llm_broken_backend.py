"""R8: a backend answer that breaks off (connection reset mid-answer, by a TCP proxy in this test between
the gateway and the real vLLM) is a 502 or a terminal SSE error event, never a truncated 200."""

import asyncio
import json
import socket
import struct
import threading

import httpx
import pytest

from serve.stack import start_gateway


class ResettingProxy:
    """Forwards to `upstream`; after `cut_after` bytes of a POST's answer it resets the connection (RST).
    GETs (the gateway's health checks) pass whole."""

    def __init__(self, upstream: str, cut_after: int):
        self.host, port = upstream.removeprefix("http://").split(":")
        self.upstream_port, self.cut_after = int(port), cut_after
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, client_r, client_w):
        up_r, up_w = await asyncio.open_connection(self.host, self.upstream_port)
        requests = [0, False]  # kept-alive connections: count each answer on its own; cut only a POST's

        async def to_upstream():
            while data := await client_r.read(65536):
                if data.startswith((b"POST", b"GET")):
                    requests[0] += 1
                    requests[1] = data.startswith(b"POST")
                up_w.write(data)
                await up_w.drain()

        forward = asyncio.ensure_future(to_upstream())
        seen, sent = 0, 0
        while data := await up_r.read(256):
            if requests[0] != seen:
                seen, sent = requests[0], 0
            sent += len(data)
            if requests[1] and sent > self.cut_after:
                break
            client_w.write(data)
            await client_w.drain()
        sock = client_w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        forward.cancel()
        client_w.close()
        up_w.close()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def cut_gateway(llm_servers, tmp_path_factory):
    proxy = ResettingProxy(llm_servers[1], cut_after=900)  # past the canary's whole answer, inside a long one
    gateway, url = start_gateway("", tmp_path_factory.mktemp("cut"), vllm_url=f"http://127.0.0.1:{proxy.port}",
                                 wait_for="/healthz")
    yield url
    gateway.stop()
    proxy.close()


def test_a_cut_answer_is_502_not_a_truncated_200(cut_gateway):
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 200, "temperature": 0, "extra_body": None}
    r = httpx.post(f"{cut_gateway}/v1/completions", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "backend_error" and "broke off" in r.json()["error"]["message"]


def test_a_cut_stream_ends_with_an_error_event_and_no_done(cut_gateway):
    with httpx.stream("POST", f"{cut_gateway}/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "backend_stream_error"

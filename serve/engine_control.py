"""vLLM's sleep API for an engine that cannot sleep: on a CPU, vLLM ignores sleep mode, so an on-demand engine there is
stopped to free its memory and started again to wake it. This small server owns one `vllm serve` process and answers
the routes vLLM's own server has for sleep mode (`--enable-sleep-mode` with VLLM_SERVER_DEV_MODE=1):

    GET  /is_sleeping   {"is_sleeping": true}    while the engine is stopped (at start too: it starts asleep)
    POST /wake_up       starts the engine and answers once its /health does (concurrent calls share one start)
    POST /sleep         stops the engine once the requests it runs have their answers (SIGTERM: vLLM drains)
    POST /collective_rpc  {"method": "reload_weights"} (a level-2 wake's middle step): nothing to do, the engine
                        started again with its weights
    GET  /health        this server itself

so that the gateway wakes and puts to sleep a CPU engine and a GPU engine the same way (serve/gateway/fleet/residency.py,
through VLLMBackend's control URL: the engine's own on a GPU, this server's on a CPU). The engine keeps its port
and its adapters (its --lora-modules) from one start to the next.

    python -m serve.engine_control --port 8200 --engine-url http://127.0.0.1:8100 --log engine.log -- vllm serve ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .launcher import ServerProcess, ServerStartError

log = logging.getLogger("rtxserve.engine_control")


class Engine:
    """The engine process, started and stopped one at a time."""

    def __init__(self, argv: list[str], engine_url: str, log_path: Path, start_timeout_s: float):
        # in this server's process group: `serve down` stops this server's group, the engine with it
        self.process = ServerProcess("vllm", argv, env=dict(os.environ), log_path=log_path,
                                     ready_url=f"{engine_url.rstrip('/')}/health", own_group=False)
        self.start_timeout_s = start_timeout_s
        self.lock = asyncio.Lock()

    @property
    def sleeping(self) -> bool:
        return not self.process.running

    async def wake_up(self) -> None:
        async with self.lock:
            if self.sleeping:
                await asyncio.to_thread(self.process.start, self.start_timeout_s)

    async def sleep(self) -> None:
        async with self.lock:
            if not self.sleeping:
                await asyncio.to_thread(self.process.stop, 60.0)


def app(engine: Engine) -> Starlette:
    async def is_sleeping(request: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.sleeping})

    async def wake_up(request: Request) -> JSONResponse:
        try:
            await engine.wake_up()
        except ServerStartError as exc:  # the log's tail for the operator; for the client (via the gateway) the cause
            log.error("the engine did not start: %s", exc)
            return JSONResponse({"error": {"message": f"the engine did not start: {exc.cause}"}}, status_code=500)
        return JSONResponse({"is_sleeping": False})

    async def sleep(request: Request) -> JSONResponse:
        await engine.sleep()
        return JSONResponse({"is_sleeping": True})

    async def collective_rpc(request: Request) -> JSONResponse:
        """The one call a level-2 wake makes (reload_weights): an engine started again has loaded its weights."""
        try:
            method = (await request.json()).get("method")
        except (ValueError, AttributeError):
            method = None
        if method != "reload_weights":
            return JSONResponse({"error": {"message": "only reload_weights is answered here"}}, status_code=400)
        return JSONResponse({"results": [None]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "is_sleeping": engine.sleeping})

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        await engine.sleep()  # this server stopping takes its engine with it

    return Starlette(routes=[Route("/is_sleeping", is_sleeping), Route("/wake_up", wake_up, methods=["POST"]),
                             Route("/sleep", sleep, methods=["POST"]), Route("/health", health),
                             Route("/collective_rpc", collective_rpc, methods=["POST"])], lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m serve.engine_control [options] -- vllm serve ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m serve.engine_control", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="where this server listens")
    parser.add_argument("--engine-url", required=True, help="where the engine listens once started")
    parser.add_argument("--log", type=Path, required=True, help="the engine's log file")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds the engine has to become healthy")
    args = parser.parse_args(argv[:split])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(argv[split + 1:], args.engine_url, args.log, args.start_timeout)
    uvicorn.run(app(engine), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())

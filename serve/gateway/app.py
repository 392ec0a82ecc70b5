"""The FastAPI gateway: create_app() wires settings, backends, routes, metrics and error handling."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal

from fastapi import FastAPI

from core import __version__

from . import canaries
from .admin.capacity import router as capacity_router
from .admin.promotions import router as promotions_router
from .admin.router import router as admin_router
from .backends.base import Backend
from .backends.factory import make_backends
from .batches.router import install_store_errors, router as batches_router
from .classify.router import HOT as CLASSIFY, router as classify_router
from .detect.router import router as detect_router
from .edge.admission import Admission
from .edge.event_stream import WIRE
from .edge.frontdoor import FrontDoor
from .edge.hotpath import HotRoutes
from .edge.logs import configure_logging
from .edge.recording import TraceMiddleware, TraceWriter
from .embeddings.router import HOT as EMBEDDINGS, router as embeddings_router
from .exceptions import GatewayError, install_handlers
from .generate.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from .generate.router import HOT as GENERATE, router as generate_router
from .image_generation.router import router as images_router
from .metrics import MetricsMiddleware
from .ner.router import HOT as NER, router as ner_router
from .rank.protocol import RerankRequest, ScoreRequest
from .rank.router import router as rank_router
from .settings import GatewaySettings
from .speech.router import router as speech_router
from .state import GatewayState
from .system.router import probes, router as system_router

log = logging.getLogger("rtxserve.gateway")
# What a batch may run (/v1/batches): each route -> the request type it accepts, which checks every line of a batch's
# file before the batch is made.
BATCH_ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                   "/v1/responses": ResponsesRequest, **{hot.path: hot.request for hot in (EMBEDDINGS, CLASSIFY, NER)},
                   "/v1/rerank": RerankRequest, "/v1/score": ScoreRequest}


async def _warm(state: GatewayState, name: str) -> None:
    try:
        await state.residency.ensure(name)
    except GatewayError as exc:  # it loads on its first request then
        log.warning("could not load %s at start: %s", name, exc.message)


def _drain_on_sigterm(state: GatewayState) -> None:
    """On SIGTERM, first go not-ready (load balancers and Kubernetes stop sending) while still serving for
    `drain_s`; then hand the signal to uvicorn, which stops accepting and lets in-flight requests finish.
    A second SIGTERM stops at once."""
    stop = signal.getsignal(signal.SIGTERM)
    if not callable(stop) or state.settings.drain_s <= 0:  # not under uvicorn's handler (e.g. in tests)
        return
    loop = asyncio.get_running_loop()

    def on_sigterm(sig, frame):
        if state.registry.draining:
            return stop(sig, frame)
        state.registry.draining = True
        log.info("SIGTERM: not ready from now on; draining for %.1f s before shutting down", state.settings.drain_s)
        loop.call_soon_threadsafe(loop.call_later, state.settings.drain_s, stop, sig, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


class GatewayApp(FastAPI):
    async def __call__(self, scope, receive, send) -> None:
        scope[WIRE] = send  # the server's own send: a stream's chunks go straight to it (edge/event_stream.py)
        await super().__call__(scope, receive, send)


def main_app() -> FastAPI:
    """The factory `rtxserve serve gateway` gives uvicorn (each worker calls it): settings from the
    environment, JSON logs."""
    settings = GatewaySettings()
    configure_logging(os.environ.get("RTXSERVE_LOG_LEVEL", "info"))
    return create_app(settings)


def create_app(settings: GatewaySettings | None = None, backends: list[Backend] | None = None) -> FastAPI:
    """Build the gateway app. Backends default to the ones the settings name."""
    settings = settings or GatewaySettings()
    backends = backends if backends is not None else make_backends(settings)
    state = GatewayState.build(settings, backends, canaries.CANARIES, BATCH_ENDPOINTS)
    trace = TraceWriter(settings.trace_dir, settings.trace_max_bytes, settings.trace_backups) if settings.trace_dir \
        else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for backend in backends:
            await backend.start()
        await state.registry.refresh()  # first look before serving; a backend that is down is not fatal
        unknown = state.registry.unknown_routes()
        if unknown:  # a settings error, found once the backends say what they serve
            raise RuntimeError(f"settings: aliases or fallbacks name models no backend serves: {', '.join(unknown)} "
                               f"(served: {', '.join(sorted(state.registry.models)) or 'none'})")
        await state.rollout.start()  # a promotion a restart interrupted: rolled back, or finished if it had switched
        loops = [asyncio.create_task(state.registry.run_health_loop()),
                 asyncio.create_task(state.residency.run()),
                 asyncio.create_task(state.rollout.run_loop()),
                 asyncio.create_task(state.headroom.run()),
                 # what a promotion put in front and is loaded on demand: loaded now, not on its first request; what
                 # one retired and a server loaded anyway (it runs every entry): unloaded where it can be
                 *(asyncio.create_task(_warm(state, name)) for name in state.rollout.pinned
                   if settings.on_demand_owner(name) == name),
                 *(asyncio.create_task(state.rollout.retire(name)) for name in state.rollout.retired)]
        if state.batches is not None:
            loops.append(asyncio.create_task(state.batches.run(app)))
        _drain_on_sigterm(state)
        # What start-up made (modules, routes, settings, clients: some 150,000 objects) lives as long as the app: kept
        # out of the collector's reach. Left in, each full collection walked them all, stopping the event loop for
        # about 100 ms every few seconds while streams ran (their objects live long enough to reach the oldest
        # generation). Given back at the end, so that an app that stops (a test's) leaves nothing the collector cannot
        # free.
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            for loop in loops:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
            for backend in backends:
                await backend.close()
            if trace is not None:
                trace.flush()

    # FastAPI's own OpenTelemetry off: the gateway traces with edge/otel.py where asked; left on, it asks each request
    # whether providers are configured (reading the environment each time)
    app = GatewayApp(title="rtxserve gateway", version=__version__, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.gateway = state
    install_handlers(app)
    install_store_errors(app)
    for router in ROUTERS:
        app.include_router(router)
    _install_middlewares(app, state, trace)
    if settings.otlp_endpoint:
        from .edge.otel import install_tracing

        install_tracing(app, settings.otlp_endpoint)
    return app


ROUTERS = (probes, system_router, classify_router, generate_router, embeddings_router, ner_router, images_router,
           detect_router, speech_router, rank_router, admin_router, promotions_router, capacity_router, batches_router)
# The hot routes (edge/hotpath.py) and the routers that document them
HOT = ((CLASSIFY, classify_router), (EMBEDDINGS, embeddings_router), (NER, ner_router),
       *((route, generate_router) for route in GENERATE))


def _install_middlewares(app: FastAPI, state: GatewayState, trace: TraceWriter | None) -> None:
    """Each added outside the ones before it: the hot routes innermost, the metrics outermost."""
    settings = state.settings
    app.add_middleware(HotRoutes, routes=[route for route, _ in HOT], state=state,  # inside admission, the door, metrics
                       documented={r.path: r for route, router in HOT for r in router.routes if r.path == route.path})
    app.add_middleware(Admission, max_concurrency=settings.max_concurrency, max_queue=settings.max_queue,
                       queue_timeout_s=settings.queue_timeout_s, access=state.access)
    app.add_middleware(FrontDoor, max_header_bytes=settings.max_header_bytes, max_body_bytes=settings.max_body_bytes)
    if trace is not None:  # outside the door and the gate: their refusals are traffic too
        app.add_middleware(TraceMiddleware, writer=trace)
    app.add_middleware(MetricsMiddleware)  # outermost: every answer is counted, refusals at the door too

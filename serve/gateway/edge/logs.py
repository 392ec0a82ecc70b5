"""JSON log lines for the gateway process, each carrying the request id the front door bound.

The gateway's modules log through the standard `logging` module; structlog's ProcessorFormatter
renders every record (uvicorn's included) as one JSON object with time, level, logger, event and
the request's context variables.
"""

from __future__ import annotations

import logging

import structlog


def configure_logging(level: str = "info") -> None:
    pre_chain = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    handler = logging.StreamHandler()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers = []  # propagate to the JSON handler

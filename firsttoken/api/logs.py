"""Server logs: the request id on every line logged while serving a request, text or JSON lines.

``current_request_id`` is set by the observability middleware from the id RequestContextMiddleware
chose (X-Request-Id); asyncio copies context into tasks, so lines logged by a route, its
preprocessing and its stream carry it. Lines from the engine thread carry ``-``.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "firsttoken_request_id", default="-"
)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
LOG_FORMATS = ("text", "json")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (unix s), level, logger, request_id, msg[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> None:
    """Root handler on stderr; uvicorn's loggers propagate to it when uvicorn runs with
    log_config=None."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

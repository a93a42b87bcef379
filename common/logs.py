"""Logging for every process: JSON log lines for log shippers, and quiet libraries for the tools.

``configure_logging`` (``--log-format text|json``) sends every logger's records to one handler. A JSON
line has ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``request_id`` (the request
being served, or null), ``replica`` (this process's replica name, or null) and ``event`` (the message),
plus ``exception`` when the record carries one. The request id comes from the record's ``request_id``
extra when a caller passes one (the engine thread does), else from :data:`REQUEST_ID`, the context
variable the front end sets for each request it serves.

Libraries log routine events at INFO: httpx one line per request (a benchmark sends hundreds), Ray and
Serve their deployment steps, transformers its loading notes. Interleaved with progress bars and result
tables they bury both. The tools call :func:`quiet_libraries` once at start; ``--verbose``
(:func:`add_verbose_flag`) keeps everything. Our own loggers (``prefixserve.*``) are left as configured.

Standard library only; no framework, no Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TextIO

# The id of the request the current task serves (set by replica/entrypoints/openai/http_frontend.py).
REQUEST_ID: ContextVar[str | None] = ContextVar("prefixserve_request_id", default=None)
LOG_FORMATS = ("text", "json")
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (see the module docstring for the fields)."""

    def __init__(self, replica: str | None = None) -> None:
        super().__init__()
        self.replica = replica

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", None) or REQUEST_ID.get(),
            "replica": self.replica,
            "event": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(
    level: str | int, log_format: str = "text", replica: str | None = None, stream: TextIO | None = None
) -> logging.Handler:
    """Send every logger's records (uvicorn's included, when it is told not to configure its
    own) to one handler on ``stream`` (stderr), formatted as text or JSON; returns the handler."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(replica) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # uvicorn, once configured in this process, keeps handlers of its own and stops propagating:
    # hand its loggers back to the root handler so they share the format.
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    return handler


# Loggers of libraries the tools drive; their INFO is noise to a user of the tools.
# "ray.serve" has its own level (Serve sets it), so it is named besides "ray".
LIBRARY_LOGGERS = (
    "httpx",
    "httpcore",
    "urllib3",
    "ray",
    "ray.serve",
    "filelock",
    "asyncio",
    "transformers",
    "huggingface_hub",
    "matplotlib",
    "PIL",
)


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``-v/--verbose``: show libraries' INFO logs too."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show libraries' INFO logs (httpx requests, Ray, transformers)",
    )


def quiet_libraries(verbose: bool = False) -> int:
    """Set the library loggers to WARNING unless ``verbose``; returns the level Ray's own
    logging should be initialised with (``ray.init(logging_level=...)``)."""
    level = logging.INFO if verbose else logging.WARNING
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    return level

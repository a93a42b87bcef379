"""common/logs.py: one JSON object per record, naming the request and the replica."""

from __future__ import annotations

import io
import json
import logging
import sys

from prefixserve.common.logs import REQUEST_ID, JsonFormatter, configure_logging


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("prefixserve.test", logging.WARNING, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_fields_and_the_request_id_from_the_context_or_the_record():
    formatter = JsonFormatter("replica-a")
    token = REQUEST_ID.set("ctx-1")
    try:
        line = json.loads(formatter.format(_record("served %d tokens", 3)))
        explicit = json.loads(formatter.format(_record("engine line", request_id="rec-2")))
    finally:
        REQUEST_ID.reset(token)
    assert line["event"] == "served 3 tokens" and line["level"] == "WARNING" and line["replica"] == "replica-a"
    assert line["request_id"] == "ctx-1" and line["logger"] == "prefixserve.test" and line["time"].endswith("+00:00")
    assert explicit["request_id"] == "rec-2"
    assert json.loads(formatter.format(_record("outside a request")))["request_id"] is None


def test_exceptions_and_newlines_stay_on_one_line():
    formatter = JsonFormatter()
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "two\nlines", (), exc_info=sys.exc_info())
    text = formatter.format(record)
    assert "\n" not in text
    assert "ValueError" in json.loads(text)["exception"]


def test_configure_logging_routes_every_logger_through_one_handler():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    try:
        configure_logging("info", "json", "r1", stream=out)
        logging.getLogger("uvicorn.access").info("GET /health 200")
        assert json.loads(out.getvalue().splitlines()[-1])["logger"] == "uvicorn.access"
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])

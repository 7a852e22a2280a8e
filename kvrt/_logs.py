"""Structured logs: kvrt's records carry `request_id`, `item_id`, `peer` and `endpoint` as
fields (logging's `extra`), and `log_json()` writes them one JSON object per line.

    kvrt.log_json(logging.DEBUG)   # {"time": "2026-12-01T09:30:00.123Z", "level": "DEBUG",
                                   #  "logger": "kvrt.producer", "message": "refused drop_select",
                                   #  "request_id": 7, ...}

An engine usually configures logging itself (handlers on the root logger). `log_json` gives
kvrt's records one destination of their own: they go to its handler and no longer also to
the engine's handlers, and calling it again replaces its handler rather than adding one.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from typing import Final, TextIO

FIELDS: Final = ("request_id", "item_id", "peer", "endpoint", "code")
LOGGER_NAME: Final = "kvrt"

_installing = threading.Lock()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with kvrt's structured fields when present. `time` is the
    record's creation time in UTC, ISO 8601 with milliseconds ("2026-12-01T09:30:00.123Z")."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, object] = {
            "time": utc_iso8601(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                data[field] = value.hex() if isinstance(value, bytes) else value
        if record.exc_info:
            data["error"] = self.formatException(record.exc_info)
        return json.dumps(data)


def utc_iso8601(seconds: float) -> str:
    """A POSIX time as UTC ISO 8601 with milliseconds and a `Z`."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _JsonHandler(logging.StreamHandler[TextIO]):
    """The handler `log_json` installs (told apart from the engine's own by its type)."""


def log_json(level: int = logging.INFO, stream: TextIO = sys.stderr) -> logging.Handler:
    """Send kvrt's logs (logger "kvrt") to `stream` as JSON lines, at `level` and above;
    returns the handler.

    Idempotent: a second call replaces the handler of the first (with its own `stream` and
    `level`), so each record is written once. kvrt's records stop propagating to the root
    logger, so an engine's own handlers do not write them a second time in their format.
    """
    handler = _JsonHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(LOGGER_NAME)
    with _installing:
        for previous in [each for each in logger.handlers if isinstance(each, _JsonHandler)]:
            logger.removeHandler(previous)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return handler

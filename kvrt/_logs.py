"""Structured logs: kvrt's records carry `request_id`, `item_id`, `peer` and `endpoint` as
fields (logging's `extra`), and `log_json()` writes them one JSON object per line.

    kvrt.log_json(logging.DEBUG)   # {"time": ..., "level": "DEBUG", "logger": "kvrt.producer",
                                   #  "message": "refused drop_select", "request_id": 7, ...}
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Final, TextIO

FIELDS: Final = ("request_id", "item_id", "peer", "endpoint", "code")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with kvrt's structured fields when present."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, object] = {
            "time": self.formatTime(record),
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


def log_json(level: int = logging.INFO, stream: TextIO = sys.stderr) -> logging.Handler:
    """Send kvrt's logs (logger "kvrt") to `stream` as JSON lines; returns the handler."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("kvrt")
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler

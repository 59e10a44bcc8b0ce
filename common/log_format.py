"""Log lines as JSON objects, one per line (`log_format: json`), for log pipelines that parse them.

Every value is escaped by json.dumps (control characters, quotes, non-ASCII), so no message or
field can forge a line; a record's structured fields (`extra={"fields": {...}}`, as the router's
access log passes them) become keys of the object."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLinesFormatter(logging.Formatter):
    """{"time": ISO-8601 UTC, "level", "logger", "message", **fields, "exception": traceback text}."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=True, default=str)


def configure_logging(log_format: str, level: int = logging.INFO) -> None:
    """The process's root handler: plain text lines or JSON lines (LOG_FORMATS)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLinesFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)

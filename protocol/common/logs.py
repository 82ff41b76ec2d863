"""Log output for fuelline's commands: readable lines for people, or one JSON object per line for
log shippers (``--log-format json``)."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, Mapping

__all__ = ["LOG_FORMATS", "configure_logging", "JsonFormatter", "StderrHandler"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# LogRecord attributes that are not a caller's ``extra=`` fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...}``: the record's ``extra=`` fields are kept as
    fields of their own, and an exception as its formatted traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is written, not when the handler was made:
    a process that swaps its stderr (a test runner capturing output, a notebook, a command run
    in-process) never has a thread log into a stream that was closed meanwhile."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # (StreamHandler sets it; the property always reads sys.stderr)
        pass


class _Tags(logging.Filter):
    """Sets fields on every record that passes (a process's place among its siblings)."""

    def __init__(self, tags: Mapping[str, Any]) -> None:
        super().__init__()
        self.tags = dict(tags)

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.tags.items():
            setattr(record, key, value)
        return True


def configure_logging(level: str | int = "INFO", fmt: str = "text", tags: Mapping[str, Any] | None = None) -> None:
    """Send log records to stderr as text lines or JSON lines (replacing earlier handlers).

    ``tags``: fields every record carries (``{"serving_process": 1}``): JSON lines have them as
    fields of their own, text lines after the logger's name (``fuelline.server [serving_process=1]``).
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = StderrHandler()
    text = TEXT_FORMAT
    if tags:
        handler.addFilter(_Tags(tags))
        text = text.replace("%(name)s", "%(name)s [" + " ".join(f"{k}={v}" for k, v in tags.items()).replace("%", "%%") + "]")
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(text))
    logging.basicConfig(level=level, handlers=[handler], force=True)

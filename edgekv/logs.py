"""Structured logging for the daemon: plain text for a terminal, one JSON object per line for journald
and log shippers (``logging.format: json``)."""

from __future__ import annotations

import json
import logging
import sys
import time
from logging.handlers import RotatingFileHandler


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in getattr(record, "fields", {}).items():
            entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class LogFileHandler(RotatingFileHandler):
    """The bounded log file. A write that fails (a full disk, flash gone read-only) is one line on stderr when it
    starts and one when writing works again, with the records lost between: Python's own handler printed a
    traceback for every record, into the journal on the same full flash. Other errors (a bad format string) are
    still reported as Python reports them."""

    def __init__(self, filename: str, max_bytes: int, backups: int) -> None:
        super().__init__(filename, maxBytes=max_bytes, backupCount=backups)
        self.lost = 0
        self._error: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self._error = None
        super().emit(record)
        if self._error is not None:
            if not self.lost:
                print(f"edgekv: logging.file {self.baseFilename}: cannot write "
                      f"({self._error.strerror or self._error}); log records are lost until it can",
                      file=sys.stderr, flush=True)
            self.lost += 1
        elif self.lost:
            print(f"edgekv: logging.file {self.baseFilename}: writing again; {self.lost} record(s) lost",
                  file=sys.stderr, flush=True)
            self.lost = 0

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._error = error
        else:
            super().handleError(record)


def setup_logging(section) -> None:
    """Configure the root logger from a ``logging:`` config section (level, format, file). A file is bounded: at
    ``max_mib`` it rolls over to ``file.1`` .. ``file.<backups>`` (so at most ``(backups + 1) * max_mib`` on disk)."""
    if section.file:
        handler = LogFileHandler(section.file, max(1, int(section.max_mib * 2**20)), section.backups)
    else:
        handler = logging.StreamHandler()
    if section.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(section.level)

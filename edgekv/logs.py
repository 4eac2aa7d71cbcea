"""Structured logging for the daemon: plain text for a terminal, one JSON object per line for journald
and log shippers (``logging.format: json``)."""

from __future__ import annotations

import json
import logging
import time


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


def setup_logging(section) -> None:
    """Configure the root logger from a ``logging:`` config section (level, format, file). A file is bounded: at
    ``max_mib`` it rolls over to ``file.1`` .. ``file.<backups>`` (so at most ``(backups + 1) * max_mib`` on disk)."""
    if section.file:
        from logging.handlers import RotatingFileHandler

        handler = RotatingFileHandler(section.file, maxBytes=max(1, int(section.max_mib * 2**20)),
                                      backupCount=section.backups)
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

"""Structured logs: one line per record, ``key=value`` fields (group, job, node, epoch when known)."""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["setup_logging"]

_FIELDS = ("group", "job", "node", "epoch", "seq", "op_id")


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [ts, record.levelname.lower(), record.name, repr(record.getMessage())]
        for f in _FIELDS:
            v = record.__dict__.get(f)
            if v is not None:
                parts.append(f"{f}={v}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("nats").setLevel(logging.WARNING)

"""Structured process log: one JSON line per lifecycle event of the process.

Requests are not logged here (the journal is their record); only what an
operator watches the process for: listening, engines leaving and rejoining
rotation, journal trouble, draining, exiting. Values pass through
``orjson``; callers never hand secrets to it.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

import orjson

__all__ = ["log_event", "set_stream"]

_stream: IO[bytes] | None = None


def set_stream(stream: IO[bytes] | None) -> None:
    """Send log lines to ``stream`` (binary) instead of standard error."""
    global _stream
    _stream = stream


def log_event(event: str, /, **fields: Any) -> None:
    """Write one log line: ``{"ts", "level", "event", **fields}``."""
    level = fields.pop("level", "error" if event.endswith(("_failed", "_error")) else "info")
    line = orjson.dumps(
        {"ts": round(time.time(), 6), "level": level, "event": event, **fields},
        default=str,
    )
    stream = _stream if _stream is not None else sys.stderr.buffer
    try:
        stream.write(line + b"\n")
        stream.flush()
    except (OSError, ValueError):
        pass  # a closed or broken log stream must not take the router down

"""Logging set-up shared by every service: one line per event, service named, trace id when in a trace.

A line emitted while a trace is current (a request's span, or only the
trace context a caller sent) ends with ``trace=<32 hex digits>``, the W3C
trace id, so a log search finds every service's lines for one request and a
trace viewer's id leads straight to them.
"""

from __future__ import annotations

import logging
import re
import sys

from opentelemetry import trace

# scheme://user:password@ or scheme://:password@ (Redis): up to the last @ before the path, as urlparse reads it.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")


def redact_url(text: str | None) -> str:
    """``text`` with the credentials of every URL in it replaced: ``redis://:***@host:6379/0``.

    Log lines, status pages and errors that name a URL go through this, so a
    password in ``redis://user:secret@host`` never reaches a log file.
    """
    if not text:
        return ""
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


class TraceIdFilter(logging.Filter):
    """Sets ``record.trace`` to `` trace=<hex>`` inside a trace, else to ``""``."""

    def filter(self, record: logging.LogRecord) -> bool:
        span_context = trace.get_current_span().get_span_context()
        record.trace = f" trace={span_context.trace_id:032x}" if span_context.is_valid else ""
        return True


def setup_logging(service: str, level: str = "INFO") -> None:
    """Send logs to stderr as ``time level service logger: message[ trace=<id>]``.

    ``aiworks up`` redirects each service's stderr to its own log file.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(TraceIdFilter())
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s%(trace)s", "%Y-%m-%dT%H:%M:%S"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Per-request access logs would dominate the file; errors still show.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


def log_level() -> int:
    """The level this process logs at now (the root logger's)."""
    return logging.getLogger().level


def set_log_level(level: int) -> None:
    """Log at ``level`` from now on (the gateway's logging API changes it while the process runs)."""
    logging.getLogger().setLevel(level)

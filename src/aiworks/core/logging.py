"""Logging set-up shared by every service: one line per event, service named, trace id when in a trace.

A line emitted while a trace is current (a request's span, or only the
trace context a caller sent) ends with ``trace=<32 hex digits>``, the W3C
trace id, so a log search finds every service's lines for one request and a
trace viewer's id leads straight to them.
"""

from __future__ import annotations

import logging
import sys

from opentelemetry import trace


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

"""Logging set-up shared by every service: one line per event, service named."""

from __future__ import annotations

import logging
import sys


def setup_logging(service: str, level: str = "INFO") -> None:
    """Send logs to stderr as ``time level service logger: message``.

    ``aiworks up`` redirects each service's stderr to its own log file.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Per-request access logs would dominate the file; errors still show.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)

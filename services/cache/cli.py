"""``aiworks cache``: the command-line wiring of the cache service.

``aiworks.cli`` adds it with ``add_cache_parser(sub)``; flags given override
the ``AIWORKS_CACHE_`` environment, as for every service.
"""

from __future__ import annotations

import argparse

FLAGS = ["host", "port", "metrics_port", "redis_url", "max_bytes", "max_entry_bytes", "default_ttl_s", "log_level"]


def cmd_cache(args: argparse.Namespace) -> None:
    from aiworks.cache.server import main
    from aiworks.cache.settings import CacheSettings
    from aiworks.cli import _settings_from
    from aiworks.core.logging import setup_logging

    settings = _settings_from(CacheSettings, args, FLAGS)
    setup_logging("cache", settings.log_level)
    main(settings)


def add_cache_parser(sub) -> argparse.ArgumentParser:
    """Add the ``cache`` command to the ``aiworks`` subparsers; returns its parser."""
    p = sub.add_parser("cache", help="run the result cache (env AIWORKS_CACHE_*)")
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="gRPC port (default 8030); 0 picks a free one")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 8031); 0 turns it off")
    p.add_argument("--redis-url", help="redis://host:port/db; unset: an in-process LRU bounded by --max-bytes")
    p.add_argument("--max-bytes", type=int, help="bound on the in-process store, in bytes")
    p.add_argument("--max-entry-bytes", type=int, help="largest value stored, in bytes")
    p.add_argument("--default-ttl-s", type=float, help="time to live of entries whose put names none")
    p.add_argument("--log-level")
    p.set_defaults(func=cmd_cache)
    return p

"""``aiworks cache``: the command-line wiring of the cache service.

``aiworks.cli`` adds it with ``add_cache_parser(sub)``; flags given override
the ``AIWORKS_CACHE_`` environment, as for every service.
"""

from __future__ import annotations

import argparse

SETTINGS = "aiworks.cache.settings:CacheSettings"
FLAGS = ["host", "port", "metrics_port", "redis_url", "max_bytes", "max_entry_bytes", "default_ttl_s", "log_level"]


def cmd_cache(args: argparse.Namespace) -> None:
    from aiworks.cache.server import main
    from aiworks.cache.settings import CacheSettings
    from aiworks.cli import _settings_from
    from aiworks.core.logging import setup_logging

    settings = _settings_from(CacheSettings, args, FLAGS)
    setup_logging("cache", settings.log_level)
    main(settings)


def add_cache_parser(sub, settings_flags: bool = True) -> argparse.ArgumentParser:
    """Add the ``cache`` command to the ``aiworks`` subparsers; returns its parser. Its flags are the settings
    fields in :data:`FLAGS` (``settings_flags=False`` leaves them out: ``aiworks --help`` need not import them)."""
    p = sub.add_parser("cache", help="run the result cache (env AIWORKS_CACHE_*)")
    if settings_flags:
        from aiworks.core.flags import add_settings_flags

        add_settings_flags(p, SETTINGS, FLAGS)
    p.set_defaults(func=cmd_cache)
    return p

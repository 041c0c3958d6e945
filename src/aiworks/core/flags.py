"""One command-line flag per concept, the same on every ``aiworks`` command.

- ``--scheduler-address host:port``: the scheduler (was also ``--scheduler``);
- ``--monitor-address URL``: the monitor's HTTP API (was ``--monitor``);
- ``--gateway-url URL``: a gateway's HTTP address (was ``--url``);
- ``--tls-dir DIR``: the folder with ``tls.crt``, ``tls.key`` and ``ca.crt`` (was also ``--cacert``, a CA file).

The old spellings still parse, hidden from ``--help``, so scripts written for them keep working.

A service command's flags (``aiworks gateway --http-port``) come from its settings model
(:func:`add_settings_flags`): each setting is declared once, with its type and description.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

DEFAULT_SCHEDULER = "127.0.0.1:8010"


def add_scheduler_address(parser, *, default: str | None = DEFAULT_SCHEDULER, help: str | None = None) -> None:
    """``--scheduler-address`` (``--scheduler`` hidden). A command that needs it without a default checks it
    itself (:func:`require`): argparse's ``required`` would refuse the old spelling."""
    text = help or "host:port of the scheduler" + (f" (default {default})" if default else "")
    parser.add_argument("--scheduler-address", dest="scheduler_address", default=default, metavar="HOST:PORT",
                        help=text)  # fmt: skip
    parser.add_argument("--scheduler", dest="scheduler_address", help=argparse.SUPPRESS)


def add_monitor_address(parser, default: str) -> None:
    """``--monitor-address`` (``--monitor`` hidden)."""
    parser.add_argument("--monitor-address", dest="monitor_address", default=default, metavar="URL",
                        help=f"URL of the monitor's HTTP API (default {default})")  # fmt: skip
    parser.add_argument("--monitor", dest="monitor_address", help=argparse.SUPPRESS)


def add_gateway_url(parser, *, default: str | None = None, help: str | None = None) -> None:
    """``--gateway-url`` (``--url`` hidden)."""
    text = help or "the gateway's HTTP address" + (f" (default {default})" if default else "")
    parser.add_argument("--gateway-url", dest="gateway_url", default=default, metavar="URL", help=text)
    parser.add_argument("--url", dest="gateway_url", help=argparse.SUPPRESS)


def add_tls_dir(parser, help: str | None = None, *, cacert: bool = False) -> None:
    """``--tls-dir``; with ``cacert``, ``--cacert FILE`` too (hidden): a CA file alone, for https:// URLs."""
    parser.add_argument(
        "--tls-dir", type=Path, metavar="DIR",
        help=help or "folder with tls.crt, tls.key and ca.crt, for a suite with mutual TLS (default $AIWORKS_TLS_DIR)",
    )  # fmt: skip
    if cacert:
        parser.add_argument("--cacert", type=Path, help=argparse.SUPPRESS)


def require(args, *flags: str) -> None:
    """Exit with argparse's usage error (status 2) when a flag without a default was not given."""
    missing = [f for f in flags if not getattr(args, f.lstrip("-").replace("-", "_"), None)]
    if missing:
        raise SystemExit(f"error: the following arguments are required: {', '.join(missing)}")


def ca_file(args) -> Path | None:
    """The CA certificate a client checks an https:// server with: ``--cacert``, else ``--tls-dir``'s ca.crt."""
    if getattr(args, "cacert", None):
        return Path(args.cacert)
    tls_dir = getattr(args, "tls_dir", None)
    return Path(tls_dir) / "ca.crt" if tls_dir else None


# ---- a service's settings as flags ----------------------------------------------------------------


def _flag_type(annotation) -> tuple[Any, str | None, list[str] | None]:
    """(type, nargs, choices) of a settings field's annotation: ``X | None`` is X, a list takes several values."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if get_origin(annotation) is Literal:
        return str, None, [str(a) for a in args]
    if get_origin(annotation) is list:
        return (args[0] if args else str), "*", None
    return annotation, None, None


def add_settings_flags(parser, settings: str, fields: list[str]) -> None:
    """One flag per settings field, named, typed and explained by the field itself (``http_port`` becomes
    ``--http-port``, its help the field's description and environment variable); a flag given overrides the
    environment. ``settings`` is ``"module:Class"``, imported here: call this only for the command being run,
    so that ``aiworks --help`` stays instant."""
    module, _, name = settings.partition(":")
    cls = getattr(importlib.import_module(module), name)
    prefix = cls.model_config.get("env_prefix", "")
    for field in fields:
        info = cls.model_fields[field]
        kind, nargs, choices = _flag_type(info.annotation)
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        description = (info.description or field).rstrip(".")
        if info.is_required():
            shown = "" if "required" in description else "; required"
        else:
            shown = f"; default {default}" if default not in (None, []) else ""
        text = description.replace("%", "%%") + f" [{prefix}{field.upper()}{shown}]"
        flag = "--" + field.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(flag, dest=field, type=kind, nargs=nargs, choices=choices, default=None, help=text)

"""How every command that shows something prints it: ``-o table`` (for people), ``-o json`` or ``-o yaml``.

A command builds one document (dicts, lists, numbers, strings; protobuf messages and dataclasses are turned
into those here) and a table function for it; :func:`emit` picks by ``args.output``. ``--json`` stays as a
hidden alias of ``-o json`` so scripts written for it keep working.

Light on imports: the command line's ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import Any, TextIO

FORMATS = ("table", "json", "yaml")


def add_output_flag(parser: argparse.ArgumentParser, default: str = "table") -> None:
    """``-o/--output table|json|yaml``, and ``--json`` as its hidden alias."""
    parser.add_argument(
        "-o", "--output", choices=FORMATS, default=default, help=f"how to print the result (default {default})"
    )
    parser.add_argument("--json", dest="output", action="store_const", const="json", help=argparse.SUPPRESS)


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: protobuf messages field for field (names as in the .proto), dataclasses
    as dicts, enums by name, paths as strings, tuples and sets as lists."""
    if hasattr(value, "DESCRIPTOR") and hasattr(value, "ListFields"):
        from google.protobuf import json_format

        return json_format.MessageToDict(
            value, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, PurePath):
        return str(value)
    return value


def render(doc: Any, output: str, table: Callable[[], str] | None = None) -> str:
    """``doc`` as ``output``; ``table`` draws it for people (without one, a table is the YAML form)."""
    if output == "json":
        return json.dumps(plain(doc), indent=2, sort_keys=True, default=str)
    if output == "yaml" or table is None:
        import yaml

        return yaml.safe_dump(plain(doc), sort_keys=True, default_flow_style=False, allow_unicode=True).rstrip("\n")
    if output != "table":
        raise ValueError(f"unknown output format {output!r}; use one of {', '.join(FORMATS)}")
    return table()


def emit(doc: Any, output: str, table: Callable[[], str] | None = None, stream: TextIO | None = None) -> None:
    """Print ``doc`` as ``output`` (see :func:`render`), flushed: a watching command shows each step at once."""
    print(render(doc, output, table), file=stream or sys.stdout, flush=True)


def emit_record(doc: Any, output: str, table: Callable[[], str], stream: TextIO | None = None) -> None:
    """One record of a stream (events, a watched rollout): JSON on one line, YAML as its own document."""
    out = stream or sys.stdout
    if output == "json":
        print(json.dumps(plain(doc), sort_keys=True, default=str), file=out, flush=True)
    elif output == "yaml":
        print("---\n" + render(doc, "yaml"), file=out, flush=True)
    else:
        print(table(), file=out, flush=True)

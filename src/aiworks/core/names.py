"""Model and version names, checked the same way wherever one arrives.

A model name becomes a folder of the model repository (Triton's layout:
``<repository>/<model>/<version>/``), so a name that can climb out of it
(``/elsewhere/echo``, ``..``, ``a/../../b``) would let a caller load files the
operator never put there. Triton's documentation names a model by its folder
and a version by a numeric sub-folder, without a character set of its own;
the suite accepts the conservative set it already uses for folders:

- model names: ``[A-Za-z0-9_.-]``, 1 to :data:`MAX_NAME_CHARS` characters,
  and never ``.`` or ``..`` alone;
- versions: decimal digits (at most 19, an int64), or empty for "the version
  the server resolves".

:func:`check_model_name` and :func:`check_version` raise INVALID_ARGUMENT
(400) naming the problem, without echoing more than a short, printable
excerpt of what was sent (and nothing of a name that is a path). :func:`inside` resolves a path (symlinks included)
and refuses one that leaves its root; its message never names the root.
"""

from __future__ import annotations

import re
from pathlib import Path

from aiworks.core.errors import InvalidArgument

MAX_NAME_CHARS = 128
_NAME_RE = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_NAME_CHARS}}}")
_VERSION_RE = re.compile(r"[0-9]{1,19}")
NAME_RULE = f"letters, digits, '_', '.' and '-' (not '.' or '..' alone), at most {MAX_NAME_CHARS} characters"


def shown(value: str, limit: int = 40) -> str:
    """A short, printable excerpt of an untrusted name, for error messages."""
    text = value if len(value) <= limit else value[:limit] + "..."
    return repr(text.encode("ascii", "backslashreplace").decode("ascii"))


def valid_model_name(name: str) -> bool:
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None and name not in (".", "..")


def check_model_name(name: str, what: str = "model name") -> str:
    """``name`` when it is a valid model name; INVALID_ARGUMENT otherwise."""
    if not valid_model_name(name):
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{what} is empty")
        if "/" in name or "\\" in name:  # a path: not echoed, the caller knows what it sent
            raise InvalidArgument(f"{what} contains '/' or '\\'; a name is one folder of the model repository")
        raise InvalidArgument(f"{what} {shown(name)} is not valid: use {NAME_RULE}")
    return name


def check_version(version: str) -> str:
    """``version`` when it is empty or decimal digits; INVALID_ARGUMENT otherwise."""
    if version and (not isinstance(version, str) or _VERSION_RE.fullmatch(version) is None):
        raise InvalidArgument(f"model version {shown(str(version))} is not valid: a version is a decimal number")
    return version


def inside(root: Path, path: Path, what: str) -> Path:
    """``path`` resolved (symlinks followed), refused unless it stays within ``root``.

    ``what`` names the thing in the error (a model name and a file, never the
    server's path): "model 'echo' folder".
    """
    base = Path(root).resolve()
    resolved = Path(path).resolve()
    if resolved != base and base not in resolved.parents:
        raise InvalidArgument(f"{what} resolves outside the model repository")
    return resolved

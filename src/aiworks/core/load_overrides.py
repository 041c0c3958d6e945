"""Triton's load overrides: a model config given with the load request, and the model's files.

Triton's model repository extension lets a load request carry parameters:

- ``config``: a model config as JSON text, used instead of the folder's
  config file;
- ``file:<path>``: the bytes of one of the model's files, ``<path>`` relative
  to the model's folder (``file:1/model.onnx``); base64 text over HTTP,
  ``bytes_param`` over gRPC. Files need a ``config`` as well.

The front ends turn those parameters into :class:`LoadOverrides` with
:func:`overrides_from_parameters`; the runtime applies them
(:mod:`aiworks.runtime.repository`). Only the shape is checked here; paths
and the config are checked where the files are written and the config read.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiworks.core.errors import InvalidArgument

CONFIG_PARAMETER = "config"
FILE_PREFIX = "file:"


@dataclass(frozen=True)
class LoadOverrides:
    """What a load request brings with it; empty: load the folder as it is."""

    config: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.config or self.files)

    @property
    def file_bytes(self) -> int:
        return sum(len(content) for content in self.files.values())

    def check(self) -> None:
        """Triton's rule: files come with the config that describes them."""
        if self.files and not self.config:
            raise InvalidArgument("a load with 'file:' parameters needs a 'config' parameter as well")


def overrides_from_parameters(parameters: Mapping[str, object], *, base64_files: bool) -> LoadOverrides:
    """The overrides in a load request's parameters.

    ``base64_files``: file contents arrive as base64 text (HTTP) rather than
    bytes (gRPC). A parameter this server does not know is refused by name.
    """
    config = ""
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key == CONFIG_PARAMETER:
            if not isinstance(value, str):
                raise InvalidArgument("load parameter 'config' must be a string holding the model config as JSON")
            config = value
        elif key.startswith(FILE_PREFIX):
            path = key[len(FILE_PREFIX) :]
            if not path:
                raise InvalidArgument("load parameter 'file:' names no file")
            files[path] = _file_content(key, value, base64_files)
        else:
            raise InvalidArgument(
                f"load parameter '{key[:64]}' is not supported (supported: 'config' and 'file:<version>/<name>')"
            )
    overrides = LoadOverrides(config, files)
    overrides.check()
    return overrides


def _file_content(key: str, value: object, base64_files: bool) -> bytes:
    if not base64_files:
        if not isinstance(value, bytes):
            raise InvalidArgument(f"load parameter '{key[:64]}' must be a bytes parameter")
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"load parameter '{key[:64]}' must be the file's content in base64")
    try:  # strict: refuses stray characters and bad padding, without a separate pass to check them
        return binascii.a2b_base64(value.encode("ascii"), strict_mode=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise InvalidArgument(f"load parameter '{key[:64]}' is not valid base64") from None

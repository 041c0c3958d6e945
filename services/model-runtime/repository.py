"""The on-disk model repository, in Triton's layout.

```
<repo>/<model>/config.pbtxt
<repo>/<model>/<version>/model.onnx        (plain or encrypted; or model.onnx.enc)
<repo>/<model>/<version>/model.onnx.sig    (optional Ed25519 signature, docs/security.md)
```

The model file's name is Triton's: the config's ``default_model_filename``
when it sets one, else the platform's own (``model.onnx``, ``model.plan``,
``model.pt``, ...), and ``model.py`` for a Triton Python-backend model.

Names arrive from callers (a load request names a model): every name is
checked with :mod:`aiworks.core.names` and every path resolved, symlinks
included, and refused unless it stays inside the repository. Messages name
the model and the file relative to its folder, never the repository's path.

A load may bring Triton's overrides (:mod:`aiworks.core.load_overrides`): a
JSON config used instead of the folder's config file, and files written into
the model's own folder first (a new model's folder is made). Each file's path
is relative to that folder; an absolute path, ``..``, a link on the way or
one that resolves elsewhere is refused, as is more than the size cap in all.
A file is written beside its target and renamed over it, so replicas that
share the repository never read half a file.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aiworks.core.errors import InvalidArgument, NotFound, PayloadTooLarge
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.model_config import CONFIG_FILES, ModelConfig, parse_config, read_config
from aiworks.core.names import check_model_name, inside, valid_model_name
from aiworks.security.model_crypto import ENC_SUFFIX

PLATFORM_FILES = {
    "onnxruntime_onnx": "model.onnx",
    "tensorrt_plan": "model.plan",
    "pytorch_libtorch": "model.pt",
    "torch_aoti": "model.pt2",
    "tensorflow_savedmodel": "model.savedmodel",
    "tensorflow_graphdef": "model.graphdef",
}
# Triton backends named in the triton backend's ``triton_backend`` parameter, by their model file.
BACKEND_FILES = {"python": "model.py"}
# Backends whose versions hold no model file (Triton's repeat backend: an empty version folder).
FILELESS_BACKENDS = frozenset({"repeat"})


def model_filename(config: ModelConfig) -> str:
    """The file (or folder) a version of ``config`` keeps its model in."""
    given = config.document.get("default_model_filename")
    if given:
        return given
    triton_backend = config.parameters.get("triton_backend", "")
    if config.backend == "triton" and triton_backend in BACKEND_FILES:
        return BACKEND_FILES[triton_backend]
    return PLATFORM_FILES.get(config.platform, "model.onnx")


@dataclass(frozen=True)
class RepositoryEntry:
    """A model folder: its config (or why it could not be read) and versions on disk."""

    name: str
    config: ModelConfig | None
    versions: tuple[int, ...]
    error: str = ""


class ModelRepository:
    """Reads model folders; never caches, so edits on disk are seen on the next load."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        # A folder whose name no request could name is not a model (Kubernetes' "..data" links among them).
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and valid_model_name(p.name) and p.name[0] != ".")

    def relative(self, text: str) -> str:
        """``text`` with the repository's path taken out, so a message can leave this process."""
        for root in {str(self.root.resolve()), str(self.root.absolute()), str(self.root)}:
            if root not in ("", ".", "/"):
                text = text.replace(root + "/", "").replace(root, "<model repository>")
        return text

    def folder(self, name: str) -> Path:
        """The folder of model ``name``: a valid name whose folder resolves inside the repository."""
        check_model_name(name)
        folder = self.root / name
        if not folder.is_dir():
            raise NotFound(f"model '{name}' is not in the model repository")
        inside(self.root, folder, f"model '{name}' folder")
        return folder

    def entry(self, name: str, config: ModelConfig | None = None) -> RepositoryEntry:
        """The model's folder; ``config`` (an override) instead of its config file when given."""
        folder = self.folder(name)
        versions = tuple(sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()))
        if config is not None:
            return RepositoryEntry(name, config, versions)
        for filename in CONFIG_FILES:
            if (folder / filename).exists():
                inside(self.root, folder / filename, f"model '{name}' file {filename}")
        try:
            config = read_config(folder)
        except Exception as exc:  # a broken config must not hide the other models
            return RepositoryEntry(name, None, versions, str(exc))
        return RepositoryEntry(name, config, versions)

    def model_file(self, config: ModelConfig, version: int) -> Path:
        if config.backend in FILELESS_BACKENDS:
            folder = self.folder(config.name) / str(version)
            inside(self.root, folder, f"model '{config.name}' folder {version}")
            return folder
        filename = model_filename(config)
        if "/" in filename or "\\" in filename or filename in ("", ".", ".."):
            raise NotFound(f"model '{config.name}': default_model_filename must be a plain file name")
        path = self.folder(config.name) / str(version) / filename
        # The file, or a folder (a SavedModel), or the file encrypted under its .enc name.
        for candidate in (path, path.with_name(filename + ENC_SUFFIX)):
            if candidate.is_file() or (candidate is path and candidate.is_dir()):
                inside(self.root, candidate, f"model '{config.name}' file {version}/{candidate.name}")
                return candidate
        raise NotFound(f"model '{config.name}' version {version} has no {filename} (nor {filename}{ENC_SUFFIX})")

    # ---- load overrides ------------------------------------------------------------------------

    def apply_overrides(self, name: str, overrides: LoadOverrides, max_file_bytes: int) -> ModelConfig | None:
        """Check ``overrides``, write their files into the model's folder; returns the config override, if any.

        The config and every path are checked before the first file is
        written; a link met on the way stops the writing there.
        """
        check_model_name(name)
        overrides.check()
        config = None
        if overrides.config:
            config = parse_config(overrides.config, fmt="json", model_name=name)
        if not overrides.files:
            return config
        total = overrides.file_bytes
        if total > max_file_bytes:
            raise PayloadTooLarge(
                f"the load's files hold {total} bytes, more than the {max_file_bytes} bytes this server accepts"
            )
        folder = self.root / name
        if folder.is_symlink() or folder.exists():
            if not folder.is_dir():
                raise InvalidArgument(f"model '{name}' folder is not a folder")
            inside(self.root, folder, f"model '{name}' folder")
        targets = [(self._file_parts(name, path), content) for path, content in overrides.files.items()]
        folder.mkdir(exist_ok=True)
        for parts, content in targets:
            self._write(name, folder, parts, content)
        return config

    @staticmethod
    def _file_parts(name: str, path: str) -> tuple[str, ...]:
        """``path``'s parts, refused unless it is a plain relative path (no root, no ``.`` or ``..``)."""
        what = f"model '{name}' file '{path[:128]}'"
        if "\\" in path or "\x00" in path or path.startswith("/") or (len(path) > 1 and path[1] == ":"):
            raise InvalidArgument(f"{what}: a file's path must be relative to the model's folder, with '/' only")
        parts = tuple(path.split("/"))
        if any(part in ("", ".", "..") for part in parts):
            raise InvalidArgument(f"{what}: a file's path may not hold empty, '.' or '..' parts")
        if len(parts) == 1 and parts[0] in CONFIG_FILES:
            raise InvalidArgument(f"{what}: the config comes in the 'config' parameter, not as a file")
        return parts

    def _write(self, name: str, folder: Path, parts: tuple[str, ...], content: bytes) -> None:
        what = f"model '{name}' file '{'/'.join(parts)[:128]}'"
        parent = folder
        for part in parts[:-1]:  # one level at a time: a link on the way is refused, never followed
            parent = parent / part
            if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
                raise InvalidArgument(f"{what}: '{part}' on its way is a link or a file")
            parent.mkdir(exist_ok=True)
            inside(folder, parent, what)
        target = parent / parts[-1]
        if target.is_symlink() or target.is_dir():
            raise InvalidArgument(f"{what}: it would replace a link or a folder")
        inside(folder, target, what)
        fd, temporary = tempfile.mkstemp(prefix=".upload-", dir=parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(content)
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

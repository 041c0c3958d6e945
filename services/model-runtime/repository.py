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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiworks.core.errors import NotFound
from aiworks.core.model_config import CONFIG_FILES, ModelConfig, read_config
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

    def entry(self, name: str) -> RepositoryEntry:
        folder = self.folder(name)
        versions = tuple(sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()))
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

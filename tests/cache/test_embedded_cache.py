"""`aiworks up`'s default: the cache runs with its in-process store, no Redis needed."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from .support import start_cached_suite


@pytest.fixture(scope="module")
def suite(cache_repository, tmp_path_factory):
    s = start_cached_suite(cache_repository, tmp_path_factory.mktemp("logs"))  # SuiteConfig defaults: cache on
    yield s
    s.supervisor.stop()


def test_the_default_suite_caches_in_process(suite):
    assert suite.supervisor.cache_address
    assert [c.name for c in suite.supervisor.children] == ["scheduler", "cache", "runtime-0", "gateway"]
    x = np.random.default_rng(7).random((2, 4), dtype=np.float32)
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        inp = grpcclient.InferInput("x", [2, 4], "FP32")
        inp.set_data_from_numpy(x)
        hits = []
        for _ in range(50):
            result = client.infer("scale", [inp])
            np.testing.assert_allclose(result.as_numpy("y"), x * 2)
            hits.append(result.get_response().parameters["cache_hit"].bool_param)
            if hits[-1]:
                break
    finally:
        client.close()
    assert hits[0] is False and hits[-1] is True
    stats = suite.cache_stats()
    assert stats.store == "memory" and stats.store_available
    assert stats.hits >= 1 and stats.puts >= 1 and 0 < stats.bytes <= stats.max_bytes

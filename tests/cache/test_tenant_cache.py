"""The result cache with two tenants, through real processes: a tenant never learns what another asked.

The suite runs with a tenants file (alice and bob, API keys) and the cache on
a private redis-server. ``private`` is cached the default way (entries per
tenant, hits not reported to clients); ``shared`` opts into
``cache_scope: shared`` and ``report_cache_hit: true``. Hits are read where
the operator reads them: each tenant's usage (``GET /v2/usage``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import requests
import yaml

from aiworks.gateway.auth import generate_api_key
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

from .support import SCALE_IO, TEST_ENV, params, write_config, write_scale

pytestmark = pytest.mark.e2e

CACHED = "response_cache { enable: true }\n"


@pytest.fixture(scope="module")
def tenant_suite(redis_server, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenant-cache")
    repository = work / "models"
    models = {
        "private": CACHED + params(preload="true"),
        "shared": CACHED + params(preload="true", cache_scope="shared", report_cache_hit="true"),
    }
    for name, extra in models.items():
        write_scale(repository / name / "1", 2.0)
        write_config(repository / name, SCALE_IO + extra)
    keys, tenants = {}, []
    for tenant in ("alice", "bob"):
        keys[tenant], digest = generate_api_key()
        tenants.append({"id": tenant, "models": ["private", "shared"], "api_keys": [digest]})
    tenants_file = work / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": tenants}))
    config = SuiteConfig.on_free_ports(
        model_repository=repository,
        replicas=1,
        log_dir=work / "logs",
        redis_url=redis_server.url,
        extra_env={**TEST_ENV, "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants_file)},
    )
    supervisor = Supervisor(config)
    try:
        supervisor.start()
        yield f"http://127.0.0.1:{config.http_port}", keys
    finally:
        supervisor.stop()


def ask(base: str, key: str, model: str, x: np.ndarray) -> dict:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = requests.post(f"{base}/v2/models/{model}/infer", json=body, headers={"x-api-key": key}, timeout=30)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]).reshape(x.shape), x * 2, rtol=1e-6)
    return r.json()


def usage(base: str, key: str, model: str) -> dict:
    r = requests.get(f"{base}/v2/usage", params={"model": model}, headers={"x-api-key": key}, timeout=10)
    assert r.ok, r.text
    [total] = r.json()["totals"]
    return total


def until_own_hit(base: str, key: str, model: str, x: np.ndarray, timeout_s: float = 5.0) -> None:
    """Repeat alice's request until her usage counts a hit (results are stored after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ask(base, key, model, x)
        if usage(base, key, model)["cache_hits"] >= 1:
            return
        assert time.monotonic() < deadline, f"{model}: alice never got a hit on her own request"
        time.sleep(0.05)


def test_another_tenants_entry_is_a_miss_and_hits_are_not_reported(tenant_suite):
    base, keys = tenant_suite
    x = np.random.default_rng(11).random((1, 4), dtype=np.float32)
    first = ask(base, keys["alice"], "private", x)
    assert "cache_hit" not in first.get("parameters", {})  # the default: the client is not told
    until_own_hit(base, keys["alice"], "private", x)  # alice's own entry serves alice...

    answer = ask(base, keys["bob"], "private", x)  # ...never bob, who asks exactly the same
    assert "cache_hit" not in answer.get("parameters", {})
    bob = usage(base, keys["bob"], "private")
    assert (bob["tenant"], bob["requests"], bob["cache_hits"]) == ("bob", 1, 0)
    assert bob["compute_seconds"] > 0  # it ran: bob paid for his own answer


def test_a_model_that_shares_its_entries_answers_every_tenant_and_says_so(tenant_suite):
    base, keys = tenant_suite
    y = np.random.default_rng(12).random((1, 4), dtype=np.float32)
    assert ask(base, keys["alice"], "shared", y)["parameters"]["cache_hit"] is False  # report_cache_hit: true
    until_own_hit(base, keys["alice"], "shared", y)
    answer = ask(base, keys["bob"], "shared", y)
    assert answer["parameters"]["cache_hit"] is True  # alice's entry, on purpose
    bob = usage(base, keys["bob"], "shared")
    assert (bob["requests"], bob["cache_hits"], bob["compute_seconds"]) == (1, 1, 0)

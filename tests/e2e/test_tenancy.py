"""Tenancy end to end: real gateways, a real scheduler and runtime, a private redis-server.

One suite (scheduler, one runtime, gateway A) plus a second gateway process
(B) on the same scheduler and Redis, both with the same tenants file, so
limits and usage are shared across two replicas the way they are in a
deployment. Gateway A also has the input-size filters and an audit log;
B has an audit log of its own (one writer per file).

Models (built here): ``scale`` (FP32 x*2, rejects NaN/Inf), ``plain`` (the
same without that rule), ``echo`` (BYTES identity that masks e-mail, phone
and ID numbers), ``slow`` (FP32, batching that holds a lone request for
1.5 s: a request that stays in flight without burning CPU), ``heavy`` (x*2
served only by a runtime replica of its own, from a repository of its own,
whose every batch takes HEAVY_S of compute: the runtime's debug delay). Beside the repository lies
``elsewhere/echo``, an echo without masking, and the repository holds a link
to it (``evil``): what a model name must never reach.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jwt
import numpy as np
import onnx
import pytest
import redis
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from e2e_support import Suite
from onnx import TensorProto, helper
from qos.qos_support import ExtraRuntime
from tritonclient.utils import InferenceServerException

from aiworks.gateway.auth import generate_api_key
from aiworks.security.audit import verify_audit_log
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

pytestmark = pytest.mark.slow

SLOW_DELAY_S = 1.5
HEAVY_S = 0.6
JWT_SECRET = b"s" * 32
TENANT_MAX_BYTES = 4096


# ---- the model repository ----------------------------------------------------------------------------


def _save(folder: Path, graph) -> None:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")


def _params(**values: str) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def _scale(folder: Path, config: str) -> None:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        folder.name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [2.0])],
    )
    _save(folder, graph)
    io = (
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )
    (folder / "config.pbtxt").write_text(f"max_batch_size: 8\n{io}{config}")


def _echo(folder: Path, config: str) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])],
        "echo",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N", 1])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["N", 1])],
    )
    _save(folder, graph)
    (folder / "config.pbtxt").write_text(
        "max_batch_size: 8\ndynamic_batching { }\n"
        'input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "echo" data_type: TYPE_STRING dims: [ 1 ] } ]\n' + config
    )


def build_repository(root: Path) -> Path:
    _scale(root / "scale", "dynamic_batching { }\n" + _params(preload="true", reject_nonfinite="true"))
    _echo(root.parent / "elsewhere" / "echo", "")  # no masking: outside the repository
    os.symlink(root.parent / "elsewhere" / "echo", root / "evil")
    _scale(root / "plain", "dynamic_batching { }\n" + _params(preload="true"))
    delay_us = int(SLOW_DELAY_S * 1e6)
    _scale(
        root / "slow",
        f"dynamic_batching {{ preferred_batch_size: [ 8 ] max_queue_delay_microseconds: {delay_us} }}\n"
        + _params(preload="true"),
    )
    _echo(root / "echo", _params(preload="true", mask_patterns="email,phone,id_card"))
    return root


# ---- tenants -------------------------------------------------------------------------------------------

TENANTS = {
    # alice's key is made with `aiworks tenants add-key` into the API keys file.
    "alice": {"models": ["scale", "plain", "echo"], "max_request_bytes": TENANT_MAX_BYTES},
    "bob": {"models": ["echo"]},
    "ops": {"admin": True},
    "rate": {"models": ["scale"], "requests_per_second": 0.01, "burst": 4},
    "conc": {"models": ["slow"], "max_concurrent_requests": 1},
    "quota": {"models": ["heavy"], "compute_quota": {"seconds": 0.3, "window_s": 86400}},
    "meter": {"models": ["scale"], "default_priority": "batch"},
    "dodger": {"models": ["heavy"], "max_concurrent_requests": 1, "compute_quota": {"seconds": 60, "window_s": 86400}},
    "jobs": {"models": ["scale"], "default_priority": "batch"},
    "jobs_plus": {"models": ["scale"], "default_priority": "batch", "max_priority": "realtime"},
}


@dataclass
class Gateway:
    http: str  # host:port
    grpc: str
    audit: Path | None  # None: its audit chain is in the Redis Stream

    @property
    def base(self) -> str:
        return f"http://{self.http}"


@dataclass
class Tenancy:
    supervisor: Supervisor
    a: Gateway
    b: Gateway
    keys: dict[str, str]
    redis_url: str
    env: dict[str, str]
    repository: Path


def _start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "redis.log", "ab")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    import redis

    while time.monotonic() < deadline:
        try:
            if redis.Redis.from_url(url, socket_timeout=0.5).ping():
                return process, url
        except redis.RedisError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


def _wait_ready(base: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway B exited: {log.read_text()[-2000:]}")
        try:
            if requests.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError("gateway B did not become ready")


@pytest.fixture(scope="module")
def tenancy(tmp_path_factory):
    work = tmp_path_factory.mktemp("tenancy")
    repository = build_repository(work / "repository")
    redis_process, redis_url = _start_redis(work / "redis")

    keys: dict[str, str] = {}
    tenants = []
    for tenant_id, fields in TENANTS.items():
        entry = {"id": tenant_id, **fields}
        if tenant_id != "alice":
            keys[tenant_id], digest = generate_api_key()
            entry["api_keys"] = [digest]
        tenants.append(entry)
    document = {
        "tenants": tenants,
        "jwt": {"algorithms": ["HS256"], "audience": "aiworks"},
        "filters": {"deny_patterns": {"id_card": None, "api_secret": "(?i)-----BEGIN [A-Z ]*PRIVATE KEY-----"}},
    }
    tenants_file = work / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump(document, sort_keys=False))
    keys_file = work / "api-keys.yaml"
    jwt_key = work / "jwt.key"
    jwt_key.write_bytes(JWT_SECRET)
    made = subprocess.run(
        [sys.executable, "-m", "aiworks", "tenants", "add-key", "alice", "--label", "e2e",
         "--api-keys-file", str(keys_file), "--tenants-file", str(tenants_file)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    keys["alice"] = made.stdout.strip()
    assert keys["alice"].startswith("aiw_") and keys["alice"] not in keys_file.read_text()
    assert keys_file.stat().st_mode & 0o777 == 0o600

    shared = {
        "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants_file),
        "AIWORKS_GATEWAY_API_KEYS_FILE": str(keys_file),
        "AIWORKS_GATEWAY_JWT_KEY_FILE": str(jwt_key),
        "AIWORKS_GATEWAY_REDIS_URL": redis_url,
        # Generous bounds: on a loaded 2-core machine a Redis call can take more than the default 5 ms,
        # and these tests are about sharing the limits, not the fallback.
        "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S": "0.5",
        "AIWORKS_GATEWAY_USAGE_TIMEOUT_S": "1.0",
        "AIWORKS_GATEWAY_USAGE_FLUSH_INTERVAL_S": "0.1",
        "AIWORKS_GATEWAY_MAX_TENSOR_ELEMENTS": "16",
        "AIWORKS_GATEWAY_MAX_STRING_BYTES": "64",
    }
    env_a = {**shared, "AIWORKS_GATEWAY_AUDIT_LOG": str(work / "audit-a.jsonl")}
    config = SuiteConfig.on_free_ports(
        model_repository=repository, log_dir=work / "logs", replicas=1, cache=False, extra_env=env_a
    )
    supervisor = Supervisor(config)
    gateway_b = heavy = None
    try:
        supervisor.start()
        # A replica of its own, with a repository of its own: only it serves "heavy", and it serves nothing else.
        _scale(work / "heavy-repository" / "heavy", "")
        suite = Suite(supervisor, "", "", work / "heavy-repository")
        heavy = ExtraRuntime(suite, "runtime-heavy", ["heavy"], {"AIWORKS_RUNTIME_DEBUG_DELAY_MS": str(HEAVY_S * 1e3)})
        heavy.start()
        b_http, b_grpc = free_port(), free_port()
        env_b = {
            **os.environ, **supervisor.caller_env("gateway"), **shared,
            # B appends its chain to the Redis Stream the replicas share (audit_sink redis).
            "AIWORKS_GATEWAY_AUDIT_SINK": "redis", "AIWORKS_GATEWAY_AUDIT_WRITER": "gateway-b",
        }  # fmt: skip
        b_log = work / "logs" / "gateway-b.log"
        with open(b_log, "ab") as out:
            gateway_b = subprocess.Popen(
                [sys.executable, "-m", "aiworks", "gateway", "--scheduler-address", supervisor.scheduler_address,
                 "--host", "127.0.0.1", "--http-port", str(b_http), "--grpc-port", str(b_grpc),
                 "--metrics-port", "0"],
                env=env_b, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        _wait_ready(f"http://127.0.0.1:{b_http}", gateway_b, b_log)
        yield Tenancy(
            supervisor,
            Gateway(f"127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}", work / "audit-a.jsonl"),
            Gateway(f"127.0.0.1:{b_http}", f"127.0.0.1:{b_grpc}", None),
            keys,
            redis_url,
            shared,
            repository,
        )
    finally:
        if gateway_b is not None:
            gateway_b.terminate()
            gateway_b.wait(20)
        if heavy is not None:
            heavy.stop()
        supervisor.stop()
        redis_process.terminate()
        redis_process.wait(10)


# ---- helpers -------------------------------------------------------------------------------------------


def scale_body(rows: int = 1, value: float | str = 1.0, model_rows: int = 4) -> dict:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, model_rows], "data": [value] * (rows * 4)}]}


def text_body(*items: str) -> dict:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(items), 1], "data": list(items)}]}


def infer(gateway: Gateway, model: str, body, key: str | None = None, headers: dict | None = None):
    headers = dict(headers or {})
    if key is not None:
        headers["x-api-key"] = key
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{gateway.base}/v2/models/{model}/infer", data=data, headers=headers, timeout=30)


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


# ---- authentication and authorization -----------------------------------------------------------------


def test_no_or_wrong_credentials_are_401_before_anything_else(tenancy):
    a = tenancy.a
    r = infer(a, "scale", scale_body())
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "credentials required" in r.json()["error"]
    r = infer(a, "scale", scale_body(), key="aiw_not-a-key")
    assert r.status_code == 401 and r.json()["error"] == "API key is not recognised"
    # Authentication comes before the body: a huge body without a key is 401, not 413.
    r = infer(a, "scale", b"x" * (TENANT_MAX_BYTES * 4))
    assert r.status_code == 401
    # A JWT signed with the right key names its tenant; a forged one is refused.
    claims = {"tenant": "alice", "aud": "aiworks", "exp": int(time.time()) + 600}
    assert infer(a, "scale", scale_body(), headers=bearer(jwt.encode(claims, JWT_SECRET, "HS256"))).ok
    forged = jwt.encode(claims, b"f" * 32, "HS256")
    assert infer(a, "scale", scale_body(), headers=bearer(forged)).status_code == 401


def test_a_model_outside_the_tenants_list_is_403(tenancy):
    a, keys = tenancy.a, tenancy.keys
    r = infer(a, "scale", scale_body(), key=keys["bob"])
    assert r.status_code == 403 and r.json()["error"] == "tenant 'bob' may not use model 'scale'"
    assert infer(a, "echo", text_body("hello"), key=keys["bob"]).ok
    client = grpcclient.InferenceServerClient(a.grpc)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("scale", [x], headers={"x-api-key": keys["bob"]})
    assert err.value.status() == "StatusCode.PERMISSION_DENIED"
    with pytest.raises(InferenceServerException) as err:
        client.infer("scale", [x])
    assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    client.close()


def test_health_is_open_metadata_and_repository_need_a_tenant(tenancy):
    base, keys = tenancy.a.base, tenancy.keys
    assert requests.get(f"{base}/v2/health/live", timeout=5).status_code == 200
    assert requests.get(f"{base}/v2/health/ready", timeout=5).status_code == 200
    assert requests.get(f"{base}/v2", timeout=5).status_code == 200
    assert requests.get(f"{base}/v2/models/scale", timeout=5).status_code == 401
    assert requests.get(f"{base}/v2/models/scale", headers=bearer(keys["bob"]), timeout=5).status_code == 403
    assert requests.get(f"{base}/v2/models/scale/ready", headers=bearer(keys["bob"]), timeout=5).status_code == 403
    meta = requests.get(f"{base}/v2/models/scale", headers=bearer(keys["alice"]), timeout=5)
    assert meta.ok and meta.json()["inputs"][0]["name"] == "x"

    index = requests.post(f"{base}/v2/repository/index", headers=bearer(keys["bob"]), timeout=10)
    assert {m["name"] for m in index.json()} == {"echo"}
    everything = requests.post(f"{base}/v2/repository/index", headers=bearer(keys["ops"]), timeout=10)
    assert {"scale", "plain", "slow", "echo"} <= {m["name"] for m in everything.json()}
    stats = requests.get(f"{base}/v2/models/stats", headers=bearer(keys["bob"]), timeout=10).json()
    assert {s["name"] for s in stats["model_stats"]} <= {"echo"}

    r = requests.post(f"{base}/v2/repository/models/plain/load", headers=bearer(keys["alice"]), timeout=10)
    assert r.status_code == 403 and "admin: true" in r.json()["error"]
    assert requests.post(f"{base}/v2/repository/models/plain/load", timeout=10).status_code == 401


def test_tritonclient_works_with_an_api_key_over_http_and_grpc(tenancy):
    a, key = tenancy.a, tenancy.keys["alice"]
    data = np.arange(8, dtype=np.float32).reshape(2, 4)

    http = httpclient.InferenceServerClient(a.http)
    x = httpclient.InferInput("x", [2, 4], "FP32")
    x.set_data_from_numpy(data, binary_data=True)
    assert http.is_server_ready()  # no key needed
    assert http.is_model_ready("scale", headers={"x-api-key": key})
    result = http.infer("scale", [x], headers={"x-api-key": key})
    np.testing.assert_allclose(result.as_numpy("y"), data * 2)
    with pytest.raises(InferenceServerException) as err:
        http.infer("scale", [x])
    assert err.value.status() == "401"
    http.close()

    grpc = grpcclient.InferenceServerClient(a.grpc)
    x = grpcclient.InferInput("x", [2, 4], "FP32")
    x.set_data_from_numpy(data)
    assert grpc.is_server_live()
    assert grpc.get_model_metadata("scale", headers=bearer(key)).name == "scale"
    result = grpc.infer("scale", [x], headers=bearer(key))
    np.testing.assert_allclose(result.as_numpy("y"), data * 2)
    grpc.close()


# ---- input filters -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,bad,status,rule,clean",
    [
        ("scale", scale_body(5), 413, "(rule max_tensor_elements)", scale_body(4)),
        ("echo", text_body("x" * 65), 413, "(rule max_string_bytes)", text_body("x" * 64)),
        (
            "scale",
            {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}]},
            400,
            "expects FP32",
            scale_body(1),
        ),
        (
            "scale",
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]},
            400,
            "expects [-1, 4]",
            scale_body(1),
        ),
        (
            "scale",
            scale_body(1, "NaN"),
            400,
            "is NaN; model 'scale' rejects non-finite values (rule reject_nonfinite)",
            scale_body(1, 3.5),
        ),
        ("scale", scale_body(1, "-Infinity"), 400, "is -Inf", scale_body(1, -3.5)),
        (
            "echo",
            text_body("ok", "id 11010519491231002X"),
            400,
            "element 1 matches deny-list pattern 'id_card'",
            text_body("ok", "id 1101"),
        ),
        (
            "echo",
            text_body("-----BEGIN RSA PRIVATE KEY-----"),
            400,
            "deny-list pattern 'api_secret'",
            text_body("-----BEGIN CERTIFICATE-----"),
        ),
    ],
    ids=["tensor-elements", "string-bytes", "datatype", "shape", "nan", "inf", "deny-builtin", "deny-custom"],
)
def test_each_filter_rule_rejects_its_case_and_passes_a_clean_one(tenancy, model, bad, status, rule, clean):
    key = tenancy.keys["alice"]
    r = infer(tenancy.a, model, bad, key=key)
    assert r.status_code == status, r.text
    assert rule in r.json()["error"]
    r = infer(tenancy.a, model, clean, key=key)
    assert r.status_code == 200, r.text


def test_body_size_rule_uses_the_tenants_lower_limit_on_both_front_ends(tenancy):
    key = tenancy.keys["alice"]
    big = text_body(*(["y" * 30] * 8))
    big["pad"] = "z" * TENANT_MAX_BYTES  # unknown fields are ignored by the codec; the size is what counts
    r = infer(tenancy.a, "echo", big, key=key)
    assert r.status_code == 413 and "for tenant 'alice' (rule max_request_bytes)" in r.json()["error"]
    # bob has no limit of his own: the gateway's applies.
    assert infer(tenancy.a, "echo", big, key=tenancy.keys["bob"]).status_code == 200

    client = grpcclient.InferenceServerClient(tenancy.a.grpc)
    text = grpcclient.InferInput("text", [8, 1], "BYTES")
    text.set_data_from_numpy(np.array([["w" * 600]] * 8, dtype=object))
    with pytest.raises(InferenceServerException) as err:
        client.infer("echo", [text], headers={"x-api-key": key})
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "max_request_bytes" in err.value.message()
    client.close()


def test_nonfinite_values_pass_when_the_model_does_not_refuse_them(tenancy):
    r = infer(tenancy.a, "plain", scale_body(1, "NaN"), key=tenancy.keys["alice"])
    assert r.status_code == 200, r.text


# ---- masking -------------------------------------------------------------------------------------------


def test_bytes_outputs_are_masked_on_both_front_ends(tenancy):
    key = tenancy.keys["alice"]
    r = infer(tenancy.a, "echo", text_body("mail user7@example.com or call 13812345678", "hello"), key=key)
    assert r.ok, r.text
    masked = "mail us" + "*" * 13 + "om or call 13" + "*" * 7 + "78"
    assert r.json()["outputs"][0]["data"] == [masked, "hello"]

    client = grpcclient.InferenceServerClient(tenancy.b.grpc)
    text = grpcclient.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([["to bob@example.org"]], dtype=object))
    result = client.infer("echo", [text], headers=bearer(key))
    assert result.as_numpy("echo").ravel().tolist() == [b"to bo" + b"*" * 11 + b"rg"]
    client.close()


# ---- limits across two gateway replicas ---------------------------------------------------------------


def test_rate_limit_is_shared_by_two_gateways_through_redis(tenancy):
    key = tenancy.keys["rate"]
    # Refused by a filter before admission: costs no token.
    for _ in range(3):
        assert infer(tenancy.a, "scale", scale_body(1, "NaN"), key=key).status_code == 400
    outcomes = {"a": [], "b": []}
    for i in range(10):  # a bucket of 4 tokens refilled at one per 100 s, whichever replica is asked
        name = "ab"[i % 2]
        r = infer(getattr(tenancy, name), "scale", scale_body(), key=key)
        outcomes[name].append(r.status_code)
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert "exceeded its rate limit of 0.01 requests/s (burst 4)" in r.json()["error"]
    codes = outcomes["a"] + outcomes["b"]
    assert codes.count(200) == 4 and codes.count(429) == 6, outcomes
    assert 429 in outcomes["a"] and 429 in outcomes["b"]  # each alone would have admitted 4 (or 5)


def _slow(gateway: Gateway, key: str):
    return infer(gateway, "slow", scale_body(), key=key)


def test_concurrency_limit_is_shared_by_two_gateways(tenancy):
    key = tenancy.keys["conc"]
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_slow, tenancy.a, key)  # held in the scheduler's queue for SLOW_DELAY_S
        time.sleep(0.5)
        started = time.monotonic()
        second = _slow(tenancy.b, key)
        assert time.monotonic() - started < SLOW_DELAY_S, "refused at admission, not after queueing"
        assert second.status_code == 429, second.text
        assert "has 1 requests in flight, its limit of 1 concurrent requests" in second.json()["error"]
        assert second.headers["retry-after"] == "1"
        assert first.result(30).status_code == 200
    assert _slow(tenancy.b, key).status_code == 200  # the slot was released


def test_compute_quota(tenancy):
    key = tenancy.keys["quota"]
    assert infer(tenancy.a, "heavy", scale_body(), key=key).status_code == 200  # HEAVY_S charged against 0.3 s
    deadline = time.monotonic() + 5
    while True:  # the charge reaches Redis one round trip after the answer
        r = infer(tenancy.b, "heavy", scale_body(), key=key)
        if r.status_code == 429 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 429, r.text
    assert "used its compute quota of 0.3 runtime-seconds per 86400 s window" in r.json()["error"]
    assert int(r.headers["retry-after"]) >= 1


# ---- usage ---------------------------------------------------------------------------------------------


def _usage(gateway: Gateway, key: str, **query):
    return requests.get(f"{gateway.base}/v2/usage", params=query, headers=bearer(key), timeout=10)


def test_usage_counts_match_the_traffic_sent(tenancy):
    key = tenancy.keys["meter"]
    sent = [(tenancy.a, 1), (tenancy.a, 2), (tenancy.b, 3), (tenancy.b, 1), (tenancy.a, 1)]
    for gateway, rows in sent:
        assert infer(gateway, "scale", scale_body(rows), key=key).status_code == 200
    assert infer(tenancy.b, "scale", scale_body(1, "NaN"), key=key).status_code == 400  # refused: not metered
    assert infer(tenancy.b, "scale", scale_body(1), key="aiw_wrong").status_code == 401

    expected = {"tenant": "meter", "model": "scale", "requests": 5, "rows": 8}
    deadline = time.monotonic() + 10
    while True:  # each replica adds its usage to Redis every 0.1 s
        r = _usage(tenancy.a, tenancy.keys["ops"], tenant="meter")
        assert r.ok, r.text
        totals = r.json()["totals"]
        if totals and totals[0]["requests"] == 5 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.json()["source"] == "redis"
    [total] = totals
    assert {k: total[k] for k in expected} == expected
    assert total["compute_seconds"] > 0 and total["cache_hits"] == 0

    own = _usage(tenancy.b, key).json()["totals"]  # a tenant sees its own usage only
    assert [(t["tenant"], t["requests"], t["rows"]) for t in own] == [("meter", 5, 8)]
    r = _usage(tenancy.b, key, tenant="alice")
    assert r.status_code == 403
    assert _usage(tenancy.b, key, start="not a time").status_code == 400

    cli = [sys.executable, "-m", "aiworks", "usage", "--tenant", "meter"]
    env = {**os.environ, "AIWORKS_API_KEY": tenancy.keys["ops"]}
    via_gateway = json.loads(subprocess.run(cli + ["--gateway-url", tenancy.b.base, "-o", "json"], env=env,
                                            capture_output=True, text=True, check=True).stdout)  # fmt: skip
    via_redis = json.loads(subprocess.run(cli + ["--redis-url", tenancy.redis_url, "--json"], capture_output=True,
                                          text=True, check=True).stdout)  # fmt: skip
    as_yaml = yaml.safe_load(subprocess.run(cli + ["--url", tenancy.b.base, "-o", "yaml"], env=env,
                                            capture_output=True, text=True, check=True).stdout)  # fmt: skip
    for report in (via_gateway, via_redis, as_yaml):
        [total] = report["totals"]
        assert {k: total[k] for k in expected} == expected
    table = subprocess.run(cli[:4] + ["--url", tenancy.b.base, "--tenant", "meter"], env=env, capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    assert "meter" in table and "scale" in table and "requests" in table


# ---- audit ---------------------------------------------------------------------------------------------


def test_audit_log_records_inferences_and_admin_actions_and_verifies(tenancy):
    a, keys = tenancy.a, tenancy.keys
    request_id = f"audit-{time.monotonic_ns()}"
    assert infer(a, "echo", text_body("secret payload user@example.com"), key=keys["alice"],
                 headers={"x-request-id": request_id}).ok  # fmt: skip
    assert infer(a, "echo", text_body("x"), headers={"x-request-id": request_id + "-anon"}).status_code == 401
    r = requests.post(f"{a.base}/v2/repository/models/echo/unload", headers=bearer(keys["bob"]), timeout=10)
    assert r.status_code == 403
    r = requests.post(f"{a.base}/v2/repository/models/plain/load", headers=bearer(keys["ops"]), timeout=120)
    assert r.status_code == 200, r.text
    b = tenancy.b
    assert infer(b, "echo", text_body("for the stream"), key=keys["alice"], headers={"x-request-id": request_id + "-b"}).ok
    time.sleep(0.3)  # lines reach the disk within 50 ms

    result = verify_audit_log(a.audit)
    assert result.ok, result.summary()
    assert result.records > 0
    done = subprocess.run([sys.executable, "-m", "aiworks", "audit", "verify", str(a.audit)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("ok:"), done.stdout + done.stderr
    # B's chain, in the shared stream, verified by the same command.
    done = subprocess.run([sys.executable, "-m", "aiworks", "audit", "verify", "-o", "json"],
                          env={**os.environ, "AIWORKS_AUDIT_REDIS_URL": tenancy.redis_url},
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["writers"]["gateway-b"]["records"] > 0, report
    lines = [f[b"line"] for _, f in redis.Redis.from_url(tenancy.redis_url).xrange("aiworks:audit")]
    [in_stream] = [json.loads(x) for x in lines if json.loads(x)["request_id"] == request_id + "-b"]
    assert (in_stream["tenant"], in_stream["model"], in_stream["status"]) == ("alice", "echo", "ok")
    assert not [x for x in lines if b"for the stream" in x]

    text = a.audit.read_text()
    assert "secret payload" not in text and "user@example.com" not in text
    records = [json.loads(line) for line in text.splitlines()]
    [ok] = [r for r in records if r["request_id"] == request_id]
    assert (ok["kind"], ok["tenant"], ok["model"], ok["version"], ok["status"]) == ("inference", "alice", "echo", "1",
                                                                                    "ok")  # fmt: skip
    assert ok["latency_ms"] > 0
    # A stranger costs no audit line (issue 15): it is counted in aiworks_gateway_refused_requests_total.
    assert not [r for r in records if r["request_id"] == request_id + "-anon"]
    admin = [r for r in records if r["kind"] == "admin"]
    loads = [r for r in admin if r["action"] == "model.load" and r["actor"] == "ops" and r["model"] == "plain"]
    assert loads and loads[-1]["status"] == "ok" and loads[-1]["details"]["auth"] == "api_key"
    assert any(r["action"] == "model.unload" and r["actor"] == "bob" and r["status"] == "permission_denied"
               for r in admin)  # fmt: skip


# ---- model names stay inside the repository (issue 15, finding 4) --------------------------------------


def _raw(gateway: Gateway, method: str, path: str, key: str, body: bytes = b"{}") -> tuple[int, str]:
    """One request whose path goes out exactly as written (no client normalises its dots or escapes)."""
    host, port = gateway.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body if method == "POST" else None,
                     headers={"x-api-key": key, "content-type": "application/json"})  # fmt: skip
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


def test_model_names_cannot_reach_outside_the_repository(tenancy):
    a, ops, alice = tenancy.a, tenancy.keys["ops"], tenancy.keys["alice"]
    outside = tenancy.repository.parent / "elsewhere" / "echo"
    server_paths = {str(tenancy.repository), str(tenancy.repository.resolve()), str(tenancy.repository.parent)}
    config_before = requests.get(f"{a.base}/v2/models/echo/config", headers=bearer(alice), timeout=10).json()
    assert config_before["parameters"]["mask_patterns"]["string_value"] == "email,phone,id_card"
    messages = []

    client = grpcclient.InferenceServerClient(a.grpc)
    try:
        for name in (str(outside), "../elsewhere/echo", "..", "evil"):  # evil: a link out of the repository
            with pytest.raises(InferenceServerException) as err:
                client.load_model(name, headers={"x-api-key": ops})
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT", (name, err.value.message())
            messages.append(err.value.message())
        assert "model 'evil' folder resolves outside the model repository" in messages[-1]
        text = grpcclient.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([["x"]], dtype=object))
        with pytest.raises(InferenceServerException) as err:
            client.infer("../echo", [text], headers={"x-api-key": ops})
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as err:
            client.infer("echo", [text], model_version="../1", headers={"x-api-key": ops})
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()

    for method, path in [
        ("POST", "/v2/repository/models/%2F" + str(outside).lstrip("/").replace("/", "%2F") + "/load"),
        ("POST", "/v2/repository/models/..%2Felsewhere%2Fecho/load"),
        ("POST", "/v2/repository/models/%2E%2E/load"),
        ("POST", "/v2/repository/models/../load"),
        ("POST", "/v2/repository/models/evil/load"),
        ("POST", "/v2/models/..%2Fecho/infer"),
        ("POST", "/v2/models/%2E%2E/infer"),
        ("GET", "/v2/models/%2E%2E/config"),
        ("GET", "/v2/models/echo/versions/..%2F1"),
    ]:
        status, body = _raw(a, method, path, ops)
        assert status == 400, (path, status, body)
        messages.append(body)

    # echo is still echo: its config, and its masking for every tenant.
    config_after = requests.get(f"{a.base}/v2/models/echo/config", headers=bearer(alice), timeout=10).json()
    assert config_after == config_before
    r = infer(a, "echo", text_body("mail user7@example.com"), key=alice)
    assert r.ok and r.json()["outputs"][0]["data"] == ["mail us" + "*" * 13 + "om"]
    index = requests.post(f"{a.base}/v2/repository/index", headers=bearer(ops), timeout=10).text
    for message in [*messages, index]:
        assert not any(path in message for path in server_paths), message


# ---- the compute quota counts what the runtime did (issue 15, finding 5) -------------------------------


def _heavy(gateway: Gateway, key: str, **parameters):
    return infer(gateway, "heavy", {**scale_body(), "parameters": parameters}, key=key)


def _usage_total(tenancy: Tenancy, tenant: str, model: str) -> dict:
    r = _usage(tenancy.a, tenancy.keys["ops"], tenant=tenant, model=model)
    assert r.ok, r.text
    totals = r.json()["totals"]
    return totals[0] if totals else {"requests": 0, "compute_seconds": 0.0}


def test_timed_out_and_cancelled_requests_are_charged_and_keep_their_slot_while_the_work_runs(tenancy):
    key = tenancy.keys["dodger"]  # one request at a time; the runtime spends HEAVY_S on each
    before = _usage_total(tenancy, "dodger", "heavy")
    answered_in = []
    for gateway in (tenancy.a, tenancy.b, tenancy.a):
        started = time.monotonic()
        r = _heavy(gateway, key, timeout=200_000)  # 200 ms: the client is answered long before the runtime ends
        answered_in.append(time.monotonic() - started)
        assert r.status_code == 504, r.text
        # The runtime still works on it, so the tenant's one slot is still taken, on either gateway.
        busy = _heavy(tenancy.b, key)
        assert busy.status_code == 429 and "has 1 requests in flight" in busy.json()["error"], busy.text
        time.sleep(HEAVY_S + 0.3)  # the work ends, the slot is given back
    assert max(answered_in) < HEAVY_S, answered_in

    # A gRPC call its client abandons (here: its deadline) is the same.
    client = grpcclient.InferenceServerClient(tenancy.a.grpc)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    try:
        with pytest.raises(InferenceServerException) as err:
            client.infer("heavy", [x], headers={"x-api-key": key}, client_timeout=0.2)
        assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert _heavy(tenancy.a, key).status_code == 429
    finally:
        client.close()
    time.sleep(HEAVY_S + 0.3)
    assert _heavy(tenancy.a, key).status_code == 200  # the slot came back once the work had ended

    deadline = time.monotonic() + 10
    while True:  # each gateway adds its usage to Redis every 0.1 s
        total = _usage_total(tenancy, "dodger", "heavy")
        charged = total["compute_seconds"] - before["compute_seconds"]
        if charged >= 5 * HEAVY_S * 0.95 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Four abandoned requests and one answered: five times the runtime's time, one request answered.
    assert 5 * HEAVY_S * 0.95 <= charged < 5 * HEAVY_S * 2, total
    assert total["requests"] - before["requests"] == 1


# ---- a tenant's class is a ceiling; JWT subjects are not tenants by default (issue 15, finding 11) ---------


def _scheduler_ok(tenancy: Tenancy, priority: str) -> float:
    """Requests of ``priority`` the runtimes' queues served (where the class is applied), summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for target in tenancy.supervisor.metrics_targets()["runtime"]:
        text = requests.get(f"http://{target}/metrics", timeout=5).text
        total += sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "aiworks_scheduler_requests_total" and s.labels.get("model") == "scale"
            and s.labels.get("priority") == priority and s.labels.get("status") == "ok"
        )  # fmt: skip
    return total


def test_a_batch_tenant_asking_for_realtime_is_served_as_batch_and_told(tenancy):
    realtime, batch = _scheduler_ok(tenancy, "realtime"), _scheduler_ok(tenancy, "batch")
    r = infer(tenancy.a, "scale", {**scale_body(), "parameters": {"priority": 1}}, key=tenancy.keys["jobs"])
    assert r.status_code == 200, r.text
    assert r.json()["parameters"]["priority_clamped"] == "batch"
    client = grpcclient.InferenceServerClient(tenancy.b.grpc)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    try:
        result = client.infer("scale", [x], priority=1, headers={"x-api-key": tenancy.keys["jobs"]})
        assert result.get_response().parameters["priority_clamped"].string_param == "batch"
        # A tenant the tenants file allows more keeps what it asked for, and is told nothing.
        result = client.infer("scale", [x], priority=1, headers={"x-api-key": tenancy.keys["jobs_plus"]})
        assert "priority_clamped" not in result.get_response().parameters
    finally:
        client.close()
    assert _scheduler_ok(tenancy, "batch") - batch == 2
    assert _scheduler_ok(tenancy, "realtime") - realtime == 1


def test_a_jwt_whose_sub_equals_a_tenant_id_is_not_that_tenant(tenancy):
    claims = {"sub": "alice", "aud": "aiworks", "exp": int(time.time()) + 600}  # no tenant claim
    r = infer(tenancy.a, "scale", scale_body(), headers=bearer(jwt.encode(claims, JWT_SECRET, "HS256")))
    assert r.status_code == 403, r.text
    assert "'sub' names one only with jwt.tenant_from_subject: true" in r.json()["error"]
    claims["tenant"] = "alice"
    assert infer(tenancy.a, "scale", scale_body(), headers=bearer(jwt.encode(claims, JWT_SECRET, "HS256"))).ok

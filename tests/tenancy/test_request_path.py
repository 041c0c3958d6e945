"""The modules together, in the order the gateway calls them, on two replicas sharing one Redis.

``Replica.infer`` is the sequence docs/tenancy.md prescribes for the data
plane: authenticate (headers) -> body size -> authorize model -> input
filters -> tenant defaults -> admit -> model -> release (charge compute) ->
meter -> mask. The usage report must match exactly the traffic that got an
answer; refused requests cost nothing.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor, serialize_bytes
from aiworks.core.errors import AIWorksError, Status
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.options import Priority, read_options
from aiworks.gateway.auth import Authenticator, generate_api_key
from aiworks.gateway.filters import InputFilter, check_body_size
from aiworks.gateway.limits import TenantLimiter
from aiworks.gateway.masking import MaskingPolicies
from aiworks.gateway.metering import UsageMeter
from aiworks.gateway.tenancy import load_tenancy, tenant_classes

GATEWAY_MAX_BYTES = 1 << 20
KEY_ACME, HASH_ACME = generate_api_key()
KEY_LAB, HASH_LAB = generate_api_key()


class Replica:
    """One gateway replica's tenancy layer around a stand-in model."""

    def __init__(self, config, specs, redis_url):
        self.auth = Authenticator(config)
        self.filters = InputFilter(max_tensor_elements=4096, max_string_bytes=256, deny_patterns=config.deny_patterns)
        self.limiter = TenantLimiter(redis_url, timeout_s=0.25)
        self.meter = UsageMeter(redis_url, flush_interval_s=0.02, timeout_s=0.5)
        self.masking = MaskingPolicies()
        self.specs = specs
        self.seen_priorities: list = []

    async def start(self):
        await self.limiter.start()
        await self.meter.start()

    async def close(self):
        await self.limiter.close()
        await self.meter.close()

    async def model(self, request: InferRequest) -> InferResponse:
        self.seen_priorities.append(request.parameters.get("priority"))
        [tensor] = request.inputs
        name = "echo" if tensor.datatype == "BYTES" else "y"
        return InferResponse(request.model, "1", [Tensor(name, tensor.datatype, tensor.shape, bytes(tensor.raw))])

    async def infer(self, headers: dict, request: InferRequest, body_size: int) -> InferResponse:
        principal = self.auth.authenticate(headers)
        tenant = principal.tenant
        check_body_size(body_size, min(GATEWAY_MAX_BYTES, tenant.max_request_bytes or GATEWAY_MAX_BYTES), tenant.id)
        self.auth.authorize(principal, request.model)
        spec = self.specs[request.model]
        rows = self.filters.check(request, spec)
        default, ceiling = tenant_classes(tenant)
        options = read_options(request.parameters, default=default or Priority.STANDARD, ceiling=ceiling)
        request.parameters["priority"] = options.priority.label  # what travels, as the model sees it here
        admission = await self.limiter.admit(tenant)
        compute_s = 0.0
        try:
            started = time.perf_counter()
            response = await self.model(request)
            compute_s = time.perf_counter() - started
        finally:
            await self.limiter.release(admission, compute_s)
        self.meter.record(tenant.id, spec.name, rows=rows, compute_s=compute_s, cache_hit=False)
        return self.masking.mask(spec, response)


def scale_request(rows: int) -> InferRequest:
    return InferRequest("scale", inputs=[Tensor.from_numpy("x", np.ones((rows, 4), dtype=np.float32))])


def echo_request(*items: str) -> InferRequest:
    raw = serialize_bytes(np.array(items, dtype=object))
    return InferRequest("echo", inputs=[Tensor("text", "BYTES", (len(items), 1), raw)])


@pytest.fixture
async def two_replicas(write_yaml, redis_server, scale_spec, echo_spec):
    config = load_tenancy(
        write_yaml(
            "tenants.yaml",
            {
                "tenants": [
                    {"id": "acme", "api_keys": [HASH_ACME], "requests_per_second": 0.5, "burst": 12},
                    {"id": "lab", "models": ["echo"], "api_keys": [HASH_LAB], "default_priority": "batch"},
                ],
                "filters": {"deny_patterns": {"id_card": None}},
            },
        )
    )
    replicas = [Replica(config, {"scale": scale_spec, "echo": echo_spec}, redis_server.url) for _ in range(2)]
    for r in replicas:
        await r.start()
    yield replicas
    for r in replicas:
        await r.close()


async def test_usage_matches_the_traffic_that_was_answered(two_replicas):
    a, b = two_replicas
    outcomes: Counter = Counter()
    answered_rows: Counter = Counter()

    async def send(replica, headers, request, body_size=100):
        try:
            response = await replica.infer(headers, request, body_size)
        except AIWorksError as exc:
            outcomes[exc.status] += 1
            return None
        outcomes["ok"] += 1
        answered_rows[(replica.auth.authenticate(headers).tenant_id, request.model)] += request.inputs[0].shape[0]
        return response

    acme, lab = {"x-api-key": KEY_ACME}, {"authorization": f"Bearer {KEY_LAB}"}
    for i in range(16):  # acme: a bucket of 12 shared by both replicas
        await send((a, b)[i % 2], acme, scale_request(1 + i % 3))
    for i in range(5):
        response = await send((a, b)[i % 2], lab, echo_request(f"mail me at user{i}@example.com", "hello"))
        assert response.outputs[0].to_numpy().ravel().tolist() == [b"mail me at us" + b"*" * 13 + b"om", b"hello"]
    # Refused before they cost anything:
    await send(a, {}, scale_request(1))  # 401
    await send(a, {"x-api-key": "aiw_wrong"}, scale_request(1))  # 401
    await send(b, lab, scale_request(1))  # 403: lab may not use scale
    await send(b, lab, echo_request("id 11010519491231002X"))  # 400: deny-list
    await send(a, lab, echo_request("x"), body_size=GATEWAY_MAX_BYTES + 1)  # 413
    await send(a, lab, echo_request("y" * 300))  # 413: max_string_bytes

    assert outcomes == {
        "ok": 17,
        Status.RESOURCE_EXHAUSTED: 4,
        Status.UNAUTHENTICATED: 2,
        Status.PERMISSION_DENIED: 1,
        Status.INVALID_ARGUMENT: 1,
        Status.PAYLOAD_TOO_LARGE: 2,
    }
    assert set(a.seen_priorities + b.seen_priorities) == {"standard", "batch"}  # lab's default class reached the model

    await a.meter.flush()  # other replicas' usage arrives within their flush interval; don't wait for it
    now = time.time()
    report = await b.meter.report(now - 3600, now + 1)  # b's report includes what a recorded
    assert report.source == "redis"
    totals = {(r.tenant, r.model): r for r in report.totals}
    assert {k: v.requests for k, v in totals.items()} == {("acme", "scale"): 12, ("lab", "echo"): 5}
    assert {k: v.rows for k, v in totals.items()} == dict(answered_rows)
    assert all(v.compute_seconds > 0 for v in totals.values())

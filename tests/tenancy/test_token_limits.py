"""Tokens-per-minute limits for generation, shared by two gateway replicas through a real (private) Redis.

Admission reserves a generation's estimate; the release settles it to the tokens used. The bucket holds
``max_tokens_per_minute`` tokens and refills at a sixtieth of that per second.
"""

from __future__ import annotations

import pytest
import redis

from aiworks.core.errors import AIWorksError, Status
from aiworks.gateway.limit_rules import LocalLimits
from aiworks.gateway.limits import TenantLimiter
from aiworks.gateway.tenancy import Tenant, parse_tenants

TIMEOUT_S = 0.25  # generous for a shared 2-core machine


async def replicas(url: str, count: int = 2) -> list[TenantLimiter]:
    limiters = [TenantLimiter(url, timeout_s=TIMEOUT_S) for _ in range(count)]
    for limiter in limiters:
        await limiter.start()
    return limiters


async def refused(coro) -> AIWorksError:
    with pytest.raises(AIWorksError) as info:
        await coro
    assert info.value.status is Status.RESOURCE_EXHAUSTED and info.value.status.http == 429
    return info.value


def left_in_redis(url: str, tenant_id: str) -> float:
    return float(redis.Redis.from_url(url).hget(f"aiworks:limits:v1:{{{tenant_id}}}:tokens", "tokens"))


def test_the_config_takes_max_tokens_per_minute_and_it_limits_the_tenant():
    config = parse_tenants({"tenants": [{"id": "acme", "maxTokensPerMinute": 600}]}, "test")
    acme = config.get("acme")
    assert acme.max_tokens_per_minute == 600 and acme.limited
    with pytest.raises(Exception, match="max_tokens_per_minute|maxTokensPerMinute"):
        parse_tenants({"tenants": [{"id": "acme", "max_tokens_per_minute": 0}]}, "test")


async def test_two_replicas_share_one_token_bucket_and_settle_to_the_real_count(redis_server):
    a, b = await replicas(redis_server.url)
    acme = Tenant(id="acme", max_tokens_per_minute=600)  # refills 10 tokens/s
    first = await a.admit(acme, reserve=400)
    assert first.backend == "redis" and first.reserved_tokens == 400
    err = await refused(b.admit(acme, reserve=400))  # the other replica sees the same bucket: ~200 left
    assert "limit of 600 tokens per minute (rule max_tokens_per_minute)" in err.message
    assert "reserves 400 tokens" in err.message
    assert 10 < err.retry_after_s <= 21  # ~200 tokens short at 10 tokens/s
    first.used_tokens = 50  # the generation stopped early: 350 tokens go back
    await a.release(first)
    assert 540 <= left_in_redis(redis_server.url, "acme") <= 600
    second = await b.admit(acme, reserve=400)
    second.used_tokens = 500  # more than reserved (a longer prompt than the estimate): the difference is taken
    await b.release(second)
    assert left_in_redis(redis_server.url, "acme") < 160
    await refused(a.admit(acme, reserve=200))
    # A reserve above the whole bucket waits for a full bucket rather than being refused for ever.
    big = Tenant(id="big", max_tokens_per_minute=60)
    slot = await a.admit(big, reserve=100)
    slot.used_tokens = 100
    await a.release(slot)
    err = await refused(b.admit(big, reserve=100))
    assert 60 < err.retry_after_s <= 101  # from -40 back to 60 at 1 token/s
    # Requests without a reserve (not generations) do not touch the bucket, nor Redis.
    plain = await a.admit(acme)
    assert plain.backend == "none"
    await a.release(plain)
    for limiter in (a, b):
        await limiter.close()


async def test_an_unused_reserve_returns_with_release_soon(redis_server):
    (a,) = await replicas(redis_server.url, 1)
    acme = Tenant(id="soon", max_tokens_per_minute=100)
    slot = await a.admit(acme, reserve=90)
    slot.used_tokens = 0  # cancelled before the prompt ran
    a.release_soon(slot)
    await a.close()  # waits for releases on their way
    assert left_in_redis(redis_server.url, "soon") >= 99


def test_the_local_fallback_keeps_its_share_of_the_bucket():
    now = [0.0]
    local = LocalLimits(share=2, clock=lambda: now[0])
    acme = Tenant(id="acme", max_tokens_per_minute=1200)  # 600 for this replica while Redis is away
    slot = local.admit(acme, reserve=500)
    with pytest.raises(AIWorksError) as info:
        local.admit(acme, reserve=500)
    assert "(this replica's 1/2 share while Redis is unreachable)" in info.value.message
    assert info.value.retry_after_s == pytest.approx(40.0)  # 400 short at 10 tokens/s
    slot.used_tokens = 100
    local.release(slot, 0.0)
    local.admit(acme, reserve=500)  # 400 came back
    now[0] = 30.0  # 30 s refill 300 tokens: 0 + 300
    with pytest.raises(AIWorksError):
        local.admit(acme, reserve=500)
    now[0] = 60.0
    local.admit(acme, reserve=500)


def test_a_generations_reserve_is_its_prompt_estimate_and_max_tokens_within_the_models_bounds():
    from aiworks.core.datatypes import Tensor, serialize_items
    from aiworks.core.inference import InferRequest
    from aiworks.core.model_config import ModelSpec
    from aiworks.gateway.token_budget import token_reserve

    spec = ModelSpec("codegen", "1", parameters={"context_tokens": "256", "max_tokens_cap": "256",
                                                 "default_max_tokens": "16"})  # fmt: skip

    def request(text: str, **params) -> InferRequest:
        raw = serialize_items([text.encode()])
        return InferRequest("codegen", "", [Tensor("text_input", "BYTES", (1,), raw)], parameters=params)

    limited, free = Tenant(id="t", max_tokens_per_minute=1000), Tenant(id="f")
    assert token_reserve(limited, spec, request("def main():", max_tokens=10)) == 3 + 10  # 11 bytes / 4, up
    assert token_reserve(limited, spec, request("héllo")) == 2 + 16  # UTF-8 bytes; the model's default
    assert token_reserve(free, spec, request("def main():", max_tokens=10)) == 0  # no limit: no reserve
    # Hostile sizes the model will refuse cannot sink the bucket: each part is at most the model's bound.
    assert token_reserve(limited, spec, request("x" * 100_000, max_tokens=10**18)) == 256 + 256
    assert token_reserve(limited, ModelSpec("iris", "1"), InferRequest("iris", "", [])) == 0  # not a generation


def test_a_text_models_reserve_is_its_texts_estimate_and_the_429_says_so():
    from aiworks.core.datatypes import Tensor, serialize_items
    from aiworks.core.inference import InferRequest
    from aiworks.core.model_config import ModelSpec, TensorSpec
    from aiworks.gateway.token_budget import text_token_reserve

    counting = ModelSpec("minilm", "1", outputs=(TensorSpec("embedding", "FP32", (384,)),
                                                 TensorSpec("token_count", "INT64", (1,))))  # fmt: skip
    silent = ModelSpec("other", "1", outputs=(TensorSpec("embedding", "FP32", (384,)),))

    def request(*texts: str) -> InferRequest:
        raw = serialize_items([t.encode() for t in texts])
        return InferRequest("minilm", "", [Tensor("text", "BYTES", (len(texts), 1), raw)])

    limited, free = Tenant(id="t", max_tokens_per_minute=100), Tenant(id="f")
    assert text_token_reserve(limited, counting, request("How do I reset it?")) == 5 + 2  # 18 bytes / 4, up; marks
    assert text_token_reserve(limited, counting, request("héllo", "abc")) == 3 + 2 * 2  # UTF-8 bytes of both
    assert text_token_reserve(free, counting, request("How do I reset it?")) == 0  # no limit: no reserve
    assert text_token_reserve(limited, silent, request("How do I reset it?")) == 0  # the model counts nothing

    local = LocalLimits(share=1, clock=lambda: 0.0)
    local.admit(limited, 90, "text")
    with pytest.raises(AIWorksError) as info:
        local.admit(limited, 20, "text")
    assert "this request reserves 20 tokens (an estimate of its input text's)" in info.value.message

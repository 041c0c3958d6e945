"""Where the traffic policies outlive the scheduler: Redis, or a local state file.

A policy is written here before the scheduler acknowledges it, and read back
at start, so a restarted scheduler keeps the weights it had (a canary at 10 %
stays at 10 %, a rolled-back one stays at 0 %) instead of serving the latest
version. Two stores:

- :class:`RedisTrafficStore` (the scheduler has ``redis_url``): one hash,
  model -> policy as JSON, and a revision counter bumped in the same
  transaction. Every scheduler polls the counter (``poll_s``) and, when it
  moved, reads the hash and puts what it holds in force, so all schedulers of
  a release agree within about a poll interval.
- :class:`FileTrafficStore` (``state_file``, as ``aiworks up`` sets): one JSON
  file, replaced atomically on every change. One scheduler owns it.

Without either, policies live in memory only, as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from aiworks.core.errors import InvalidArgument, Unavailable
from aiworks.scheduler.traffic_state import ShadowPolicy, TrafficPolicy

log = logging.getLogger(__name__)

FORMAT = 1  # the layout of a stored policy; bumped if it ever changes incompatibly


def policy_to_json(policy: TrafficPolicy, seed: dict[str, int] | None = None) -> dict:
    """A policy as stored; ``seed``: the deployment's seed weights it was last reconciled with (see Scheduler)."""
    shadow = policy.shadow
    return {
        "format": FORMAT,
        "model": policy.model,
        "weights": dict(policy.weights),
        "seed": None if seed is None else dict(seed),
        "shadow": None if shadow is None else {
            "version": shadow.version, "fraction": shadow.fraction,
            "compare": shadow.compare, "tolerance": shadow.tolerance,
        },
    }  # fmt: skip


def policy_from_json(data: dict) -> TrafficPolicy:
    """A stored policy; InvalidArgument when it is not one."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidArgument("not a stored traffic policy of this format")
    shadow = data.get("shadow")
    try:
        return TrafficPolicy(
            str(data["model"]),
            {str(v): w for v, w in dict(data.get("weights") or {}).items()},
            None if not shadow else ShadowPolicy(
                str(shadow["version"]), float(shadow["fraction"]), str(shadow["compare"]), float(shadow["tolerance"])
            ),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"stored traffic policy is malformed: {exc}") from None


class TrafficStore(Protocol):
    """What the scheduler needs from a durable home of its traffic policies."""

    describe: str
    seeds: dict[str, dict[str, int]]  # per model, the seed weights its stored policy was last reconciled with

    async def load(self) -> dict[str, TrafficPolicy]: ...

    async def save(self, policy: TrafficPolicy, seed: dict[str, int] | None = None) -> None:
        """Store ``policy`` (an empty one removes the model's) with ``seed``; Unavailable when it could not be."""

    async def watch(self, apply: Callable[[dict[str, TrafficPolicy]], Awaitable[None] | None]) -> None:
        """Call ``apply`` with every policy whenever another writer changed them; runs until cancelled."""

    async def close(self) -> None: ...


def _decode_all(raw: dict, where: str) -> tuple[dict[str, TrafficPolicy], dict[str, dict[str, int]]]:
    """The policies stored, and the seed each was last reconciled with."""
    policies, seeds = {}, {}
    for model, text in raw.items():
        model = model.decode() if isinstance(model, bytes) else str(model)
        try:
            data = json.loads(text)
            policy = policy_from_json(data)
        except (ValueError, InvalidArgument) as exc:
            log.error("ignoring the stored traffic policy of %s in %s: %s", model, where, exc)
            continue
        policies[policy.model] = policy
        if isinstance(data.get("seed"), dict):
            seeds[policy.model] = {str(v): w for v, w in data["seed"].items()}
    return policies, seeds


class FileTrafficStore:
    """Policies in one JSON file ``{"format": 1, "policies": {model: policy}}``, replaced atomically."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.describe = "state file"
        self._policies: dict[str, TrafficPolicy] = {}
        self.seeds: dict[str, dict[str, int]] = {}
        self._lock = asyncio.Lock()

    async def load(self) -> dict[str, TrafficPolicy]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, ValueError) as exc:  # a broken file must not keep the control plane down
            log.error("cannot read the traffic state file (%s); starting without stored policies", exc)
            data = {}
        raw = data.get("policies", {}) if isinstance(data, dict) else {}
        self._policies, self.seeds = _decode_all({m: json.dumps(p) for m, p in raw.items()}, "the state file")
        return dict(self._policies)

    async def save(self, policy: TrafficPolicy, seed: dict[str, int] | None = None) -> None:
        async with self._lock:
            policies, seeds = dict(self._policies), dict(self.seeds)
            seeds.pop(policy.model, None)
            if policy.empty:
                policies.pop(policy.model, None)
            else:
                policies[policy.model] = policy
                if seed is not None:
                    seeds[policy.model] = dict(seed)
            stored = {m: policy_to_json(p, seeds.get(m)) for m, p in sorted(policies.items())}
            text = json.dumps({"format": FORMAT, "policies": stored}, indent=1)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._write, text)
            except OSError as exc:
                raise Unavailable(f"cannot store the traffic policy: {exc.strerror or exc}") from None
            self._policies, self.seeds = policies, seeds

    def _write(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".traffic-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    async def watch(self, apply) -> None:
        await asyncio.Event().wait()  # one scheduler owns the file: nobody else changes it

    async def close(self) -> None:
        pass


class RedisTrafficStore:
    """Policies in the Redis hash ``<prefix>policies``, with the revision ``<prefix>revision``."""

    def __init__(self, url: str, *, prefix: str = "aiworks:scheduler:traffic:", timeout_s: float = 1.0,
                 poll_s: float = 0.5):  # fmt: skip
        from aiworks.core.redis_client import fail_fast_redis

        self.describe = "Redis"
        self._redis = fail_fast_redis(url, max_connections=4, timeout_s=timeout_s)
        self._hash = f"{prefix}policies"
        self._revision = f"{prefix}revision"
        self.poll_s = poll_s
        self._seen: bytes | None = None  # the revision whose policies are in force here
        self.seeds: dict[str, dict[str, int]] = {}

    async def _read(self) -> tuple[bytes | None, dict[str, TrafficPolicy]]:
        async with self._redis.pipeline(transaction=True) as pipe:
            revision, raw = await pipe.get(self._revision).hgetall(self._hash).execute()
        policies, self.seeds = _decode_all(raw, "Redis")
        return revision, policies

    async def load(self) -> dict[str, TrafficPolicy]:
        try:
            revision, policies = await self._read()
        except Exception as exc:  # redis.RedisError, OSError: start anyway, watch() catches up
            log.warning("Redis is unreachable for the stored traffic policies (%s); will retry", type(exc).__name__)
            return {}
        self._seen = revision
        return policies

    async def save(self, policy: TrafficPolicy, seed: dict[str, int] | None = None) -> None:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                if policy.empty:
                    pipe.hdel(self._hash, policy.model)
                else:
                    pipe.hset(self._hash, policy.model, json.dumps(policy_to_json(policy, seed)))
                pipe.incr(self._revision)
                await pipe.execute()
        except Exception as exc:
            raise Unavailable(f"cannot store the traffic policy in Redis ({type(exc).__name__})") from None

    async def watch(self, apply) -> None:
        warned = False
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                revision = await self._redis.get(self._revision)
                if revision == self._seen:
                    warned = False
                    continue
                revision, policies = await self._read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not warned:
                    log.warning("cannot read the stored traffic policies from Redis (%s); the ones in force stay",
                                type(exc).__name__)  # fmt: skip
                    warned = True
                continue
            warned = False
            result = apply(policies)
            if asyncio.iscoroutine(result):
                await result
            self._seen = revision

    async def close(self) -> None:
        await self._redis.aclose()


def open_store(redis_url: str | None, state_file: Path | None, *, poll_s: float = 0.5,
               prefix: str = "aiworks:scheduler:traffic:") -> TrafficStore | None:  # fmt: skip
    """Redis when a URL is given, else the state file when one is, else None (memory only)."""
    if redis_url:
        return RedisTrafficStore(redis_url, prefix=prefix, poll_s=poll_s)
    if state_file is not None:
        return FileTrafficStore(state_file)
    return None

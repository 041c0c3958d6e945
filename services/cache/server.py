"""Wires the cache together and runs it: ``aiworks cache``."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aiworks.cache.dataplane import CacheDataPlane
from aiworks.cache.servicer import CALLERS_BY_METHOD, CacheServicer
from aiworks.cache.settings import CacheSettings
from aiworks.cache.store import MemoryStore, Store
from aiworks.core import metrics
from aiworks.core.lifecycle import settle_memory, stop_event
from aiworks.core.looplag import start_loop_lag_probe
from aiworks.core.rpc import add_port, create_server, set_serving
from aiworks.core.tracing import setup_tracing, shutdown_tracing
from aiworks.pb.cache.v1 import cache_pb2, cache_pb2_grpc
from aiworks.security.callers import server_check
from aiworks.security.keyring import watch_internal_token

log = logging.getLogger("aiworks.cache")


def build_store(settings: CacheSettings) -> Store:
    """Redis when a URL is configured, the in-process LRU otherwise."""
    if settings.redis_url:
        from aiworks.cache.redis_store import RedisStore

        return RedisStore(settings.redis_url, prefix=settings.key_prefix)
    return MemoryStore(settings.max_bytes)


def build_dataplane(settings: CacheSettings) -> CacheDataPlane:
    return CacheDataPlane(
        build_store(settings),
        max_entry_bytes=settings.max_entry_bytes,
        default_ttl_s=settings.default_ttl_s,
        store_timeout_s=settings.store_timeout_s,
        retry_after_s=settings.retry_after_s,
        failure_threshold=settings.failure_threshold,
    )


class CacheCollector(metrics.ScrapeCollector):
    """The data plane's counters as ``aiworks_cache_<name>_total``, and ``aiworks_cache_backend_up{store}``.

    The store is up (1) while its circuit breaker is closed: the breaker opens
    after ``failure_threshold`` failed or slow calls in a row, and closes on the
    first call that succeeds again. Both are plain reads, safe from the scrape
    thread.
    """

    def __init__(self, dataplane: CacheDataPlane):
        self.dataplane = dataplane

    def collect(self):
        for name, value in self.dataplane.counters.as_dict().items():
            yield CounterMetricFamily(f"aiworks_cache_{name}", f"Cache {name.replace('_', ' ')}.", value=value)
        up = GaugeMetricFamily(
            metrics.CACHE_BACKEND_UP, "1 when the cache's store answers, 0 while its breaker is open.", labels=["store"]
        )
        up.add_metric([self.dataplane.store.name], 0.0 if self.dataplane.breaker.is_open else 1.0)
        yield up


async def serve(settings: CacheSettings) -> None:
    stop = stop_event()
    setup_tracing("cache", settings)
    tls = settings.tls_files()
    callers = server_check(
        settings, "cache", settings.host, cache_pb2.DESCRIPTOR.services_by_name["CacheService"], CALLERS_BY_METHOD
    )
    dataplane = build_dataplane(settings)
    server, health = create_server(settings.max_message_bytes, callers)
    cache_pb2_grpc.add_CacheServiceServicer_to_server(CacheServicer(dataplane), server)
    port = add_port(server, f"{settings.host}:{settings.port}", tls)
    await server.start()
    collector = CacheCollector(dataplane).register()
    exposition, metrics_port = None, None
    if settings.metrics_port:  # 0 turns /metrics off here (the suite's local default)
        exposition, metrics_port = metrics.serve_metrics_or_warn(settings.metrics_port, settings.host)
    await set_serving(health, True)
    lag = start_loop_lag_probe("cache")
    token_watch = watch_internal_token(settings, callers)  # a rotated internal token, taken without a restart
    log.info(
        "cache serving gRPC%s on %s:%d (callers checked by %s) with the %s store%s",
        " with mutual TLS" if tls else "",
        settings.host,
        port,
        callers.auth.describe,
        dataplane.store.name,
        f" (metrics on :{metrics_port})" if exposition else "",
    )
    settle_memory()  # started: what exists now lives as long as the process
    await stop.wait()
    log.info("cache stopping")
    if token_watch is not None:
        token_watch.cancel()
    await set_serving(health, False)
    await server.stop(grace=5)
    lag.stop()
    await metrics.stop_metrics(exposition)
    collector.unregister()
    await dataplane.close()
    shutdown_tracing()


def main(settings: CacheSettings) -> None:
    asyncio.run(serve(settings))

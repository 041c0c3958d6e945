"""The result cache: ``aiworks.cache.v1.CacheService`` over an in-process LRU or Redis (docs/cache.md).

- ``keys`` and ``policy``: what a key hashes, which models and requests are cached (used by the gateway);
- ``store`` and ``redis_store``: the two stores behind one interface;
- ``dataplane``: the logic (timeouts, breaker, counters); ``servicer``, ``server``, ``settings``, ``cli``.
"""

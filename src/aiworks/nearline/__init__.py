"""Nearline tier (docs/tiers.md): asynchronous inference requests queued on a Redis Stream.

- :mod:`aiworks.nearline.queue`: the stream, the request records and their results (kept for a TTL);
- :mod:`aiworks.nearline.worker`: the consumer that sends queued requests through the gateway.
"""

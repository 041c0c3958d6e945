"""Result streams for digital twins: inference results published to Redis Streams, read over SSE (docs/tiers.md)."""

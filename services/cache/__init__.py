"""Cache: the shared result cache (see issue: cache service)."""

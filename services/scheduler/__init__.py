"""Scheduler: per-model queues, dynamic batching and replica routing."""

"""The offline and nearline tiers in ``aiworks status --redis-url``: jobs not yet ended, and the async backlog."""

from __future__ import annotations

import asyncio

from aiworks.batch.jobs import Job, JobStore
from aiworks.nearline.queue import AsyncQueue


async def _read(url: str) -> tuple[list[Job], int]:
    store = JobStore.from_url(url)
    queue = AsyncQueue.from_url(url)
    try:
        jobs = [job for job in [await store.get(i) for i in await store.active_ids()] if job is not None]
        return sorted(jobs, key=lambda j: j.created_at), await queue.backlog()
    finally:
        await store.close()
        await queue.close()


def fetch_tiers(url: str) -> tuple[list[Job], int]:
    return asyncio.run(_read(url))


def format_tiers(jobs: list[Job], backlog: int) -> str:
    lines = ["", f"BATCH JOBS (not yet ended: {len(jobs)})"]
    if jobs:
        lines.append(f"  {'id':<32} {'tenant':<12} {'endpoint':<34} {'status':<12} {'done':>15} {'failed':>7}")
        for job in jobs:
            done = job.completed + job.failed
            share = f"{100 * done / job.total:.0f}%" if job.total else "-"
            progress = f"{done}/{job.total or '?'} {share}"
            lines.append(f"  {job.id:<32} {job.tenant or '-':<12} {job.infer_path:<34} {job.status:<12} "
                         f"{progress:>15} {job.failed:>7}")  # fmt: skip
    lines.append(f"ASYNC REQUESTS queued: {backlog}")
    return "\n".join(lines)

"""``aiworks status``: the scheduler's view of queues, replicas, ejections, weights and KV-cache room, as tables.

It calls as ``admin``: with the token of ``$AIWORKS_INTERNAL_TOKEN_FILE`` (default
``.aiworks/internal-token``, which ``aiworks up`` makes) over plaintext, or, against a
suite with mutual TLS (``aiworks up --tls``), with the certificate in ``AIWORKS_TLS_DIR``
(``tls.crt``, ``tls.key``, ``ca.crt``; ``.aiworks/certs/admin`` for ``aiworks up``).
"""

from __future__ import annotations

import grpc

from aiworks.core.errors import AIWorksError
from aiworks.pb.scheduler.v1 import scheduler_pb2
from aiworks.scheduler.client import BlockingSchedulerClient
from aiworks.security.callers import TOKEN_FILE_ENV, ClientCaller, tool_caller
from aiworks.security.tls import TLSFiles, tool_tls
from aiworks.traffic_cli import format_shadows


def fetch_status(
    address: str, tls: TLSFiles | None = None, caller: ClientCaller | None = None
) -> scheduler_pb2.StatusResponse:
    try:
        with BlockingSchedulerClient(address, tls, caller, timeout_s=3) as scheduler:
            return scheduler.status()
    except grpc.RpcError as exc:
        hint = rpc_hint(exc, tls)
        raise SystemExit(f"error: cannot reach the scheduler at {address}: {exc.details()}{hint}") from None


def rpc_hint(exc: grpc.RpcError, tls: TLSFiles | None) -> str:
    """What a tool's user can do about a refused or failed call to an internal service."""
    if tls is None and exc.code() == grpc.StatusCode.UNAVAILABLE:
        return " (if the suite runs with mutual TLS, set AIWORKS_TLS_DIR to a certificate folder)"
    if tls is None and exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return f" (set {TOKEN_FILE_ENV} to the suite's token file, or AIWORKS_TLS_DIR to an admin certificate folder)"
    return ""


def format_status(reply: scheduler_pb2.StatusResponse) -> str:
    lines = []
    if reply.caller_auth:
        warn = "  <- anyone who reaches the scheduler may call it" if reply.caller_auth.startswith("INSECURE") else ""
        lines.append(f"callers checked by: {reply.caller_auth}{warn}")
    lines.append(f"replicas ({len(reply.replicas)}):")
    lines.append(
        f"  {'id':<14} {'address':<22} {'device':<6} {'state':<9} {'batches':>7} {'rows':>6} {'ewma ms':>8} "
        f"{'done':>7} {'errors':>6} {'ejected':>7} {'beat':>6}  models"
    )
    for r in reply.replicas:
        state = "ejected" if r.ejected else ("live" if r.live else "stopping" if r.stopping else "down")
        ejected = f"{r.times_ejected}x" + (f" {r.ejected_for_s:.0f}s" if r.ejected else "")
        lines.append(
            f"  {r.replica_id:<14} {r.address:<22} {r.device:<6} {state:<9} {r.outstanding_batches:>7} "
            f"{r.outstanding_rows:>6} {r.ewma_latency_ms:>8.1f} {r.batches_done:>7} {r.consecutive_errors:>6} "
            f"{ejected:>7} {r.last_heartbeat_age_s:>5.1f}s  {', '.join(r.models)}"
            + (f"  [{', '.join(f'{k}={v}' for k, v in sorted(r.labels.items()))}]" if r.labels else "")
        )
        for g in r.gpus:  # a gpu replica's GPUs, as of its last heartbeat
            lines.append(
                f"    gpu {g.index}: {g.name}, {g.memory_used_bytes / 2**30:.1f}/{g.memory_total_bytes / 2**30:.1f} GiB, "
                f"{g.utilization_ratio:.0%} busy"
            )
    lines.extend(format_kv(reply.replicas))
    lines.append(f"queues ({len(reply.queues)}):")
    lines.append(
        f"  {'model':<16} {'version':<8} {'queued':>7} {'rt/std/batch':>13} {'rows':>6} {'KiB':>7} {'batches':>9} "
        f"{'rows done':>10} {'avg batch':>10} {'429':>6} {'504':>6} {'retries':>7}"
    )
    for q in reply.queues:
        avg = q.rows / q.batches if q.batches else 0.0
        classes = f"{q.queued_realtime}/{q.queued_standard}/{q.queued_batch}"
        lines.append(
            f"  {q.model:<16} {q.version:<8} {q.queued_requests:>7} {classes:>13} {q.queued_rows:>6} "
            f"{q.queued_bytes / 1024:>7.0f} {q.batches:>9} {q.rows:>10} {avg:>10.2f} {q.rejected:>6} {q.expired:>6} "
            f"{q.retries:>7}" + ("  draining" if q.draining else "")
        )
    lines.append(f"version weights ({len(reply.traffic)}):")
    for p in reply.traffic:
        total = sum(p.weights.values()) or 1
        shares = ", ".join(f"v{v} {w} ({100 * w / total:.0f}%)" for v, w in sorted(p.weights.items()))
        if p.HasField("shadow") and p.shadow.version:
            shares = (shares + "; " if shares else "") + f"shadow v{p.shadow.version} ({100 * p.shadow.fraction:g}%)"
        lines.append(f"  {p.model:<16} {shares}")
    if reply.shadows:
        lines.append(f"shadow traffic ({len(reply.shadows)}):")
        for model in sorted({s.model for s in reply.shadows}):
            lines.append(f"  {model}:")
            lines.extend(
                "  " + line for line in format_shadows([s for s in reply.shadows if s.model == model]).splitlines()
            )
    b = reply.retry_budget
    lines.append(
        f"retry budget: {b.active_retries} retries of {b.active} batches in flight; "
        f"{b.allowed} allowed, {b.denied} denied since start"
    )
    return "\n".join(lines)


def format_kv(replicas) -> list[str]:
    """Generative versions' KV-cache room per replica, as of their last heartbeat (no lines without any)."""
    rows = [(r, k) for r in replicas for k in r.kv]
    if not rows:
        return []
    lines = [f"generation KV cache ({len(rows)}):"]
    lines.append(
        f"  {'replica':<14} {'model':<16} {'version':<8} {'used tokens':>12} {'free':>8} {'budget':>8} {'use':>5} "
        f"{'waiting':>7} {'age':>6}"
    )
    for r, k in rows:
        used = max(0, k.budget_tokens - k.free_tokens)
        share = used / k.budget_tokens if k.budget_tokens else 0.0
        lines.append(
            f"  {r.replica_id:<14} {k.model:<16} {k.version:<8} {used:>12} {k.free_tokens:>8} {k.budget_tokens:>8} "
            f"{share:>5.0%} {k.waiting_sequences:>7} {r.kv_age_s:>5.1f}s"
        )
    return lines


def show_status(address: str, tls_dir: str | None = None, output: str = "table", redis_url: str | None = None) -> None:
    """The scheduler's status; with ``redis_url``, also the batch jobs not yet ended and the async backlog."""
    from aiworks.core.output import emit, plain

    try:
        tls = tool_tls(tls_dir)
        caller = None if tls else tool_caller()
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None
    reply = fetch_status(address, tls, caller)
    if not redis_url:
        emit(reply, output, lambda: format_status(reply))
        return
    from aiworks.batch.status import fetch_tiers, format_tiers

    jobs, backlog = fetch_tiers(redis_url)
    doc = {"scheduler": plain(reply), "batch_jobs": plain(jobs), "async_backlog": backlog}
    emit(doc, output, lambda: format_status(reply) + "\n" + format_tiers(jobs, backlog))

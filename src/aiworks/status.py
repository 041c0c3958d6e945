"""``aiworks status``: the scheduler's view of queues and replicas, as tables."""

from __future__ import annotations

import grpc

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc


def show_status(address: str) -> None:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=3)
    except grpc.RpcError as exc:
        raise SystemExit(f"error: cannot reach the scheduler at {address}: {exc.details()}") from None
    print(f"replicas ({len(reply.replicas)}):")
    print(f"  {'id':<14} {'address':<22} {'device':<6} {'live':<5} {'batches':>7} {'rows':>6} {'beat':>6}  models")
    for r in reply.replicas:
        print(
            f"  {r.replica_id:<14} {r.address:<22} {r.device:<6} {'yes' if r.live else 'no':<5} "
            f"{r.outstanding_batches:>7} {r.outstanding_rows:>6} {r.last_heartbeat_age_s:>5.1f}s  {', '.join(r.models)}"
        )
    print(f"queues ({len(reply.queues)}):")
    print(f"  {'model':<16} {'version':<8} {'queued':>7} {'rows':>6} {'batches':>9} {'rows done':>10} {'avg batch':>10}")
    for q in reply.queues:
        avg = q.rows / q.batches if q.batches else 0.0
        print(
            f"  {q.model:<16} {q.version:<8} {q.queued_requests:>7} {q.queued_rows:>6} {q.batches:>9} "
            f"{q.rows:>10} {avg:>10.2f}"
        )

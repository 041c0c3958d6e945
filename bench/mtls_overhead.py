"""What mutual TLS on every internal hop costs: the suite in token mode vs with ``--tls``, side by side.

Two suites run at once on this machine, each as ``aiworks up`` starts it
(scheduler, runtime replicas, gateway; no cache, no monitor, so nothing but
the transport differs):

  plain   the default: plaintext on loopback, callers proved by the installation's
          token (metadata once per call or stream);
  mtls    ``aiworks up --tls``: mutual TLS between gateway, scheduler and runtimes,
          callers named by their certificates, and TLS on the gateway's gRPC port
          (the gateway serves TLS whenever it has a certificate, so the client's
          hop is encrypted too, as a deployment with mTLS on would have it).

The same closed-loop gRPC client (``aiworks.bench.loadgen``) drives digits
version 2 at the given concurrency, alternating plain and mtls in rounds so the
machine's noise hits both. Reported per case: throughput, p50 and p99 latency
(median over rounds), and the CPU time each process spent per request (read
from /proc around each measurement, so it does not depend on what else runs),
which shows where a cost goes. The cost is the ratio mtls / plain.

On a shared machine those figures swing with the batch sizes that contention
produces, so a second part isolates the transport: one bidirectional stream
between two processes (what ``InferStream`` and ``ExecuteStream`` are), a
message of ``--message-bytes`` each way, plaintext vs mutual TLS with the
suite's own channel and port code (``aiworks.core.rpc``), alternating rounds;
it reports the CPU both processes spend per message round trip.

Usage: python bench/mtls_overhead.py [--rounds 4] [--duration-s 8] [--concurrency 64]
       [--replicas 2] [--stream-messages 20000] [--repository DIR] [--out bench/results/mtls_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from aiworks.bench.loadgen import sweep
from aiworks.core.rpc import add_port, client_channel
from aiworks.security.certs import write_certificates
from aiworks.security.tls import TLSFiles
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CASES = ("plain", "mtls")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def processes(supervisor: Supervisor) -> dict[str, int]:
    """Kind (runtimes summed under "runtime") -> pids."""
    found: dict[str, list[int]] = {}
    for child in supervisor.children:
        found.setdefault(child.kind, []).append(child.process.pid)
    return found


def cpu_by_kind(supervisor: Supervisor) -> dict[str, float]:
    return {kind: sum(cpu_seconds(p) for p in pids) for kind, pids in processes(supervisor).items()}


async def one_round(supervisor: Supervisor, args, ca: bytes | None) -> dict:
    before = cpu_by_kind(supervisor)
    [result] = await sweep(
        "grpc", f"127.0.0.1:{supervisor.config.grpc_port}", args.model, args.version, [args.concurrency],
        warmup_s=args.warmup_s, duration_s=args.duration_s, report=lambda line: None, root_certificates=ca,
    )  # fmt: skip
    after = cpu_by_kind(supervisor)
    # Warm-up requests count too: CPU is read around warm-up and measurement alike.
    served = result.requests * (args.warmup_s + args.duration_s) / args.duration_s
    cpu_ms = {kind: 1e3 * (after[kind] - before[kind]) / max(served, 1) for kind in after}
    return {**asdict(result), "cpu_ms_per_request": cpu_ms}


# ---- the transport alone: one stream, plaintext vs mutual TLS ------------------------------------------

ECHO = "/bench.Echo/Stream"


async def serve_echo(port: int, tls_dir: str | None) -> None:
    async def stream(request_iterator, context):
        async for message in request_iterator:
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {"Stream": handler}),))
    add_port(server, f"127.0.0.1:{port}", TLSFiles.from_dir(Path(tls_dir) / "scheduler") if tls_dir else None)
    await server.start()
    await server.wait_for_termination()


async def stream_round(port: int, tls: TLSFiles | None, messages: int, size: int, window: int = 64) -> float:
    """Wall seconds to send ``messages`` of ``size`` bytes on one stream and read each echo, ``window`` in flight."""
    channel = client_channel(f"127.0.0.1:{port}", 1 << 24, tls, server_name="scheduler")
    call = channel.stream_stream(ECHO, request_serializer=lambda b: b, response_deserializer=lambda b: b)()
    payload = b"x" * size
    for _ in range(window):  # warm: the handshake and the stream set up, outside the measurement
        await call.write(payload)
        await call.read()
    started = time.perf_counter()

    async def writer():
        for _ in range(messages):
            await call.write(payload)

    task = asyncio.create_task(writer())
    for _ in range(messages):
        await call.read()
    await task
    elapsed = time.perf_counter() - started
    await call.done_writing()
    await channel.close()
    return elapsed


def transport(args, tmp: Path) -> dict:
    certs = tmp / "certs"
    write_certificates(certs, ["localhost", "127.0.0.1"], ["scheduler", "gateway"])
    servers, ports = {}, {}
    try:
        for case in CASES:
            ports[case] = free_port()
            command = [sys.executable, __file__, "--serve-echo", str(ports[case])]
            servers[case] = subprocess.Popen(command + (["--tls-dir", str(certs)] if case == "mtls" else []))
        time.sleep(2.0)
        tls = {"plain": None, "mtls": TLSFiles.from_dir(certs / "gateway")}
        rounds: dict[str, list[dict]] = {case: [] for case in CASES}
        for i in range(args.rounds):
            for case in CASES if i % 2 == 0 else CASES[::-1]:
                server_cpu, client_cpu = cpu_seconds(servers[case].pid), time.process_time()
                wall = asyncio.run(stream_round(ports[case], tls[case], args.stream_messages, args.message_bytes))
                server_cpu = cpu_seconds(servers[case].pid) - server_cpu
                client_cpu = time.process_time() - client_cpu
                n = args.stream_messages
                rounds[case].append({
                    "messages_per_s": n / wall,
                    "client_cpu_us_per_message": 1e6 * client_cpu / n,
                    "server_cpu_us_per_message": 1e6 * server_cpu / n,
                })  # fmt: skip
                r = rounds[case][-1]
                print(
                    f"stream round {i + 1} {case:>5}: {r['messages_per_s']:8.0f} msg/s  CPU per round trip: "
                    f"client {r['client_cpu_us_per_message']:.1f} us, server {r['server_cpu_us_per_message']:.1f} us",
                    flush=True,
                )
    finally:
        for process in servers.values():
            process.terminate()
            process.wait(10)
    keys = ("messages_per_s", "client_cpu_us_per_message", "server_cpu_us_per_message")
    return {
        "message_bytes": args.message_bytes,
        "messages_per_round": args.stream_messages,
        "summary": {case: {k: statistics.median(r[k] for r in rounds[case]) for k in keys} for case in CASES},
        "rounds": rounds,
    }


def summary(rounds: list[dict]) -> dict:
    kinds = rounds[0]["cpu_ms_per_request"]
    return {
        "throughput_rps": statistics.median(r["throughput_rps"] for r in rounds),
        "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
        "p99_ms": statistics.median(r["p99_ms"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "cpu_ms_per_request": {k: statistics.median(r["cpu_ms_per_request"][k] for r in rounds) for k in kinds},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per case, alternating (default 4)")
    parser.add_argument("--duration-s", type=float, default=8.0, help="measured seconds per round (default 8)")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="warm-up seconds per round (default 2)")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop clients (default 64)")
    parser.add_argument("--replicas", type=int, default=2, help="runtime replicas per suite (default 2)")
    parser.add_argument("--model", default="digits")
    parser.add_argument("--version", default="2")
    parser.add_argument("--repository", type=Path, help="demo model repository (built in a temporary folder if unset)")
    parser.add_argument("--stream-messages", type=int, default=20000, help="messages per transport round")
    parser.add_argument("--message-bytes", type=int, default=600, help="bytes each way (digits v2: ~550)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mtls_overhead.json")
    parser.add_argument("--serve-echo", type=int, help=argparse.SUPPRESS)  # the transport part's server process
    parser.add_argument("--tls-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        asyncio.run(serve_echo(args.serve_echo, args.tls_dir))
        return

    with tempfile.TemporaryDirectory(prefix="aiworks-mtls-bench-") as tmp:
        repo = args.repository
        if repo is None:
            from aiworks.demo.models import build_demo_repository

            repo = Path(tmp) / "model-repository"
            build_demo_repository(repo, progress=lambda m: print(m, flush=True))
        stream = transport(args, Path(tmp))
        suites: dict[str, Supervisor] = {}
        try:
            for case in CASES:
                config = SuiteConfig.on_free_ports(
                    model_repository=repo, log_dir=Path(tmp) / case / "logs", replicas=args.replicas,
                    cache=False, log_level="WARNING", tls=case == "mtls",
                )  # fmt: skip
                suites[case] = Supervisor(config)
                suites[case].start()
                print(f"{case}: callers checked by {suites[case].caller_auth}", flush=True)
            ca = (suites["mtls"].tls_dir / "ca.crt").read_bytes()
            rounds: dict[str, list[dict]] = {case: [] for case in CASES}
            for i in range(args.rounds):
                order = CASES if i % 2 == 0 else CASES[::-1]  # ABBA: neither case always goes first
                for case in order:
                    r = asyncio.run(one_round(suites[case], args, ca if case == "mtls" else None))
                    rounds[case].append(r)
                    print(
                        f"round {i + 1} {case:>5}: {r['throughput_rps']:8.1f} infer/s  p50 {r['p50_ms']:6.2f} ms  "
                        f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}  CPU ms/request "
                        + " ".join(f"{k} {v:.3f}" for k, v in sorted(r["cpu_ms_per_request"].items())),
                        flush=True,
                    )
        finally:
            for supervisor in suites.values():
                supervisor.stop()

    summaries = {case: summary(rounds[case]) for case in CASES}
    plain, mtls = summaries["plain"], summaries["mtls"]
    ratios = {
        "throughput": mtls["throughput_rps"] / plain["throughput_rps"],
        "p50": mtls["p50_ms"] / plain["p50_ms"],
        "p99": mtls["p99_ms"] / plain["p99_ms"],
    }
    cost = 1 - ratios["throughput"]
    print(f"\n{'case':>6} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8}  CPU ms per request")
    for case in CASES:
        s = summaries[case]
        cpu = " ".join(f"{k} {v:.3f}" for k, v in sorted(s["cpu_ms_per_request"].items()))
        print(f"{case:>6} {s['throughput_rps']:>9.1f} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f}  {cpu}")
    print(
        f"mtls / plain: throughput {ratios['throughput']:.3f} (cost {100 * cost:.1f} %), "
        f"p50 {ratios['p50']:.3f}, p99 {ratios['p99']:.3f}"
    )
    sp, sm = stream["summary"]["plain"], stream["summary"]["mtls"]
    extra_us = (sm["client_cpu_us_per_message"] + sm["server_cpu_us_per_message"]) - (
        sp["client_cpu_us_per_message"] + sp["server_cpu_us_per_message"]
    )
    print(
        f"one stream, {args.message_bytes} B each way: plain {sp['messages_per_s']:.0f} msg/s, "
        f"mtls {sm['messages_per_s']:.0f} msg/s; TLS adds {extra_us:.1f} us of CPU per round trip (both ends)"
    )
    doc = {
        "benchmark": "mtls_overhead",
        "date": dt.date.today().isoformat(),
        "command": "python bench/mtls_overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "repository", "serve_echo", "tls_dir")
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other work",
        "model": f"{args.model} v{args.version}",
        "concurrency": args.concurrency,
        "replicas": args.replicas,
        "summary": summaries,
        "ratios_mtls_over_plain": ratios,
        "throughput_cost_percent": 100 * cost,
        "rounds": rounds,
        "stream": stream,
        "stream_tls_cpu_us_per_round_trip": extra_us,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

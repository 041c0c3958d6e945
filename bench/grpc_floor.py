"""What one hop costs here: raw TCP, unary gRPC, a stream message, and forwarding.

Reproduces the transport figures docs/architecture.md and docs/benchmarks.md
cite. Starts, as separate Python processes on free ports, a backend gRPC
server (a unary echo and a stream echo) and a forwarder that relays each unary
call to the backend either as a unary call or over one open stream, then
measures round trips at concurrency 1 from a third process (this one).

Usage: python bench/grpc_floor.py [--calls 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import grpc

from aiworks.supervisor.supervisor import free_port

PAYLOAD = b"x" * 300


def _echo_handlers():
    async def unary(request, context):
        return request

    async def stream(request_iterator, context):
        async for message in request_iterator:
            yield message

    return grpc.method_handlers_generic_handler(
        "floor.Echo",
        {"U": grpc.unary_unary_rpc_method_handler(unary), "S": grpc.stream_stream_rpc_method_handler(stream)},
    )


async def serve_backend(port: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_echo_handlers(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def serve_forwarder(port: int, backend: int) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{backend}")
    unary = channel.unary_unary("/floor.Echo/U")
    stream_call = channel.stream_stream("/floor.Echo/S")()
    lock = asyncio.Lock()

    async def via_unary(request, context):
        return await unary(request)

    async def via_stream(request, context):
        async with lock:  # concurrency 1 here: one message in flight on the stream
            await stream_call.write(request)
            return await stream_call.read()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "floor.Forward",
                {
                    "U": grpc.unary_unary_rpc_method_handler(via_unary),
                    "S": grpc.unary_unary_rpc_method_handler(via_stream),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_tcp_echo(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        while True:  # the readiness probe connects first, then the measurement
            conn, _ = s.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(4096):
                conn.sendall(data)
            conn.close()


def p50_ms(samples: list[float]) -> float:
    samples.sort()
    return samples[len(samples) // 2] * 1e3


def tcp_rtt(port: int, calls: int) -> float:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        conn.sendall(PAYLOAD)
        received = 0
        while received < len(PAYLOAD):
            received += len(conn.recv(4096))
        samples.append(time.perf_counter() - started)
    conn.close()
    return p50_ms(samples)


async def grpc_rtts(backend: int, forwarder: int, calls: int) -> dict[str, float]:
    results = {}
    back = grpc.aio.insecure_channel(f"127.0.0.1:{backend}")
    fwd = grpc.aio.insecure_channel(f"127.0.0.1:{forwarder}")
    cases = {
        "unary call": back.unary_unary("/floor.Echo/U"),
        "forwarded as a unary call": fwd.unary_unary("/floor.Forward/U"),
        "forwarded over an open stream": fwd.unary_unary("/floor.Forward/S"),
    }
    for name, method in cases.items():
        for _ in range(50):
            await method(PAYLOAD)
        samples = []
        for _ in range(calls):
            started = time.perf_counter()
            await method(PAYLOAD)
            samples.append(time.perf_counter() - started)
        results[name] = p50_ms(samples)
    stream = back.stream_stream("/floor.Echo/S")()
    for _ in range(50):
        await stream.write(PAYLOAD)
        await stream.read()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await stream.write(PAYLOAD)
        await stream.read()
        samples.append(time.perf_counter() - started)
    results["message on an open stream"] = p50_ms(samples)
    await back.close()
    await fwd.close()
    return results


def _wait_port(port: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--role", choices=["backend", "forwarder", "tcp"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "backend":
        return asyncio.run(serve_backend(args.port))
    if args.role == "forwarder":
        return asyncio.run(serve_forwarder(args.port, args.backend))
    if args.role == "tcp":
        return serve_tcp_echo(args.port)

    backend, forwarder, tcp = free_port(), free_port(), free_port()
    me = [sys.executable, __file__]
    children = [
        subprocess.Popen([*me, "--role", "backend", "--port", str(backend)]),
        subprocess.Popen([*me, "--role", "tcp", "--port", str(tcp)]),
    ]
    try:
        _wait_port(backend)
        children.append(subprocess.Popen([*me, "--role", "forwarder", "--port", str(forwarder), "--backend", str(backend)]))
        _wait_port(forwarder)
        _wait_port(tcp)
        print(f"p50 round trip at concurrency 1, {args.calls} calls, {len(PAYLOAD)}-byte messages")
        print(f"  {'raw TCP':<34} {tcp_rtt(tcp, args.calls):7.3f} ms")
        for name, value in asyncio.run(grpc_rtts(backend, forwarder, args.calls)).items():
            print(f"  {name:<34} {value:7.3f} ms")
    finally:
        for child in children:
            child.kill()
            child.wait()


if __name__ == "__main__":
    main()

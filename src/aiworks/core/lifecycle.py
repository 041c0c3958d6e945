"""Process lifecycle shared by the services: run until SIGTERM/SIGINT, then stop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger(__name__)


def stop_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, so servers can drain and exit cleanly."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


# Allocations between young-generation collections: a request allocates hundreds of objects (messages,
# futures, tasks), almost all freed by reference counting, so CPython's default of 700 ran a collection
# every few requests (6 % of the gateway's CPU under load, bench/profile_hops.py).
GC_YOUNG_THRESHOLD = 20_000


def settle_memory() -> None:
    """Once a service has started: move what it has built so far out of the collector's sight.

    What start-up makes (modules, settings, models, clients) lives as long as
    the process, so ``gc.freeze`` keeps the collector from walking it again on
    every full collection; a larger young generation makes collections rare.
    Cycles are still collected.
    """
    if os.environ.get("AIWORKS_GC_TUNE", "1") == "0":
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


# Run in the child *after* it was started: set the death signal (prctl PR_SET_PDEATHSIG = 1),
# give up if the parent is already gone, then become the real program (the setting survives exec).
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def orphan_proof(argv: list[str]) -> list[str]:
    """``argv`` wrapped so the child dies with this process (PR_SET_PDEATHSIG), without a ``preexec_fn``.

    ``preexec_fn`` makes subprocess fork() the whole process and run Python in
    the copy before exec; in a process whose gRPC threads are busy, gRPC's own
    fork handlers then abort that copy now and then ("epoll_wait error: Bad
    file descriptor", exit -6). Without ``preexec_fn`` CPython starts children
    with vfork, which runs no fork handlers; the child sets its death signal
    itself, in a few lines of Python, and then execs the real program.
    """
    return [sys.executable, "-c", _SHIM, str(os.getpid()), *argv]


def terminate(process: subprocess.Popen, name: str, timeout_s: float = 10.0) -> None:
    """SIGTERM ``process`` (it stops cleanly), SIGKILL it after ``timeout_s`` if it lingers; reaps it."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop in %.0f s; killing it", name, timeout_s)
        process.kill()
        process.wait()


def import_onnxruntime_extensions():
    """``onnxruntime_extensions``, imported without its side effect on the environment.

    Its converter module sets ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` in ``os.environ`` when the
    package is imported; every process started afterwards (a suite's services, a tritonserver) would parse
    protobuf in pure Python. The value this process started with is put back
    (``aiworks.PROTOBUF_IMPLEMENTATION_AT_START``).
    """
    import onnxruntime_extensions

    from aiworks import PROTOBUF_IMPLEMENTATION_AT_START

    if PROTOBUF_IMPLEMENTATION_AT_START is None:
        os.environ.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    else:
        os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = PROTOBUF_IMPLEMENTATION_AT_START
    return onnxruntime_extensions

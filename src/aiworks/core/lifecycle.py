"""Process lifecycle shared by the services: run until SIGTERM/SIGINT, then stop."""

from __future__ import annotations

import asyncio
import ctypes
import signal


def stop_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, so servers can drain and exit cleanly."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for child processes: SIGTERM them when their parent dies, so none is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass

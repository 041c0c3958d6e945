"""An :class:`~aiworks.runtime.llm_engine.Engine` driven from asyncio (the ``llm`` backend's side of it).

The engine itself has no asyncio in it; :class:`AsyncEngine` gives it a
thread of its own that steps while there is work, and turns each generation
into an async iterator of the engine's events whose closing cancels its
sequence.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from aiworks.runtime.llm_engine import Engine, Event, Sampling


class AsyncEngine:
    """An :class:`Engine` driven from asyncio: steps in a thread of its own, generations as async iterators.

    The thread steps for as long as the engine is busy and hands each step's
    events to the event loop (``call_soon_threadsafe``) without waiting for
    them to be delivered: the next step does not wait for the event loop,
    which is busy sending the last step's tokens. It sleeps when the engine
    is idle, and a new generation wakes it.
    """

    def __init__(self, engine: Engine, on_step=None):
        self.engine = engine
        self.on_step = on_step  # called on the event loop after each step's events are delivered (gauges)
        self._queues: dict[int, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        engine, post = self.engine, self._post
        while not self._closed:
            if not engine.busy():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                if engine.prefilling():  # first tokens go out before the decode batch runs
                    if post(engine.prefill_step(), False):
                        time.sleep(0)  # and the event loop gets the GIL now to send them (time to first token)
                    events = engine.decode_step()
                else:
                    events = engine.step()
            except Exception as exc:  # the decoder failed: every generation running or waiting ends with it
                events = engine.fail_all(f"generation failed: {type(exc).__name__}")
            post(events, True)

    def _post(self, events: list[Event], stepped: bool) -> bool:
        if events or stepped:
            try:
                self._loop.call_soon_threadsafe(self._deliver, events, stepped)
            except RuntimeError:  # the event loop closed: nobody waits for these
                self._closed = True
        return bool(events)

    def _deliver(self, events: list[Event], stepped: bool = False) -> None:
        for event in events:
            queue = self._queues.get(id(event.seq))
            if queue is not None:
                queue.put_nowait(event)
        if stepped and self.on_step is not None:
            self.on_step()

    async def generate(self, prompt: np.ndarray, sampling: Sampling, heal: bool = False, rank: int = 1,
                       scope: str = ""):  # fmt: skip
        """The :class:`Event` s of one generation; leaving the iteration early cancels it.

        ``rank``: its QoS class's rank in admission; ``scope``: who it shares prompts with (both
        :meth:`Engine.add`). When the consumer is slower than the engine, the events waiting are joined
        into one (their text, their token count), so each hop after it carries one message for several
        steps instead of one per step. The first event is never joined: the first token goes out alone,
        whatever the consumer's pace.
        """
        seq = self.engine.add(prompt, sampling, heal, rank, scope)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[id(seq)] = queue
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="llm-step", daemon=True)
            self._thread.start()
        self._wake.set()
        try:
            first = True
            while True:
                event = await queue.get()
                if first:
                    first = False
                elif not queue.empty():  # the consumer fell behind: one event for all the steps waiting
                    events = [event]
                    while not queue.empty() and not events[-1].finished:
                        events.append(queue.get_nowait())
                    event = Event(seq, "".join(e.text for e in events), events[-1].finished,
                                  sum(e.tokens for e in events), sum((e.logprobs for e in events), ()))  # fmt: skip
                yield event
                if event.finished:
                    return
        finally:
            self._queues.pop(id(seq), None)
            if seq.state != "done":
                self.engine.cancel(seq)
                self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

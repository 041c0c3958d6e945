"""Progress bars for long steps: tqdm when it is installed and wanted, silence otherwise."""

from __future__ import annotations

import sys
from contextlib import contextmanager


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def set_description_str(self, text: str) -> None:
        pass


@contextmanager
def bar(total: int, desc: str, enabled: bool = True, unit: str = "step"):
    """A progress bar on stderr with ``update()``/``set_postfix_str()``."""
    if not enabled:
        yield _Silent()
        return
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes from requirements-lifecycle.txt
        yield _Silent()
        return
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True) as t:
        yield t


class Steps:
    """The steps of a long command, one line each on stderr with the time so far: ``convert [2/5] 3.1 s: ...``.

    For steps that cannot report their own progress (an export, a quantization), so a user sees what it is
    doing and that it is alive. Calling it with a step's name starts that step; disabled, it prints nothing.
    """

    def __init__(self, command: str, total: int, enabled: bool = True, stream=None):
        import time

        self.command = command
        self.total = total
        self.enabled = enabled
        self.done = 0
        self._stream = stream
        self._clock = time.monotonic
        self._started = self._clock()

    def __call__(self, text: str) -> None:
        self.done += 1
        if self.enabled:
            elapsed = self._clock() - self._started
            print(f"{self.command} [{self.done}/{self.total}] {elapsed:.1f} s: {text}",
                  file=self._stream or sys.stderr, flush=True)  # fmt: skip

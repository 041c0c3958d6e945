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

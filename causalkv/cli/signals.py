"""Signals before the command's own handling starts: torch-free, so the light entry point
(`causalkv.cli.main`) can turn a SIGINT or SIGTERM during the imports into one line.

`Terminated` is what SIGTERM raises in the main thread (as SIGINT raises
``KeyboardInterrupt``); `causalkv.cli.faults` maps both to their exit statuses.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Terminated", "sigterm_raises"]


class Terminated(BaseException):
    """SIGTERM, raised in the main thread the way SIGINT raises ``KeyboardInterrupt`` (a
    ``BaseException``, so ``except Exception`` cleanup code lets it through)."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (once: a second
    SIGTERM during the clean-up is ignored). An inherited ``SIG_IGN`` is kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

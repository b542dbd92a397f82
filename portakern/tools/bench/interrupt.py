"""A Ctrl-C latch for long benchmark runs.

Python's default SIGINT handler raises KeyboardInterrupt in whatever Python code runs next.
When that is a gc callback (jax registers one; the runner collects garbage after every case)
or a ``__del__``, the exception is printed as "Exception ignored" and lost, and the benchmark
runs on. The latch's handler records the interrupt before raising, and the runner calls
``check()`` after each measurement and case, so a swallowed KeyboardInterrupt is raised again
at the next point where the runner can stop cleanly and write what it measured.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class InterruptLatch:
    """Set by SIGINT, cleared only by ``installed()``; ``check()`` re-raises a lost Ctrl-C."""

    def __init__(self) -> None:
        self.requested = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[InterruptLatch]:
        """Install the handler for the block (main thread only: signal handlers can only be
        set there; elsewhere the default behaviour stays and ``check`` never fires)."""
        self.requested = False
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self.handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


LATCH = InterruptLatch()

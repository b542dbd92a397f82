"""A CPU hog: a busy loop pinned to one core, for `portakern bench --hog`.

Why: the benchmark's ratios must not bend under load (issue 26). ``--hog`` measures every case
twice, quiet and then with this hog running, so the result file holds both ratios side by
side (``result["hog"]``) and the run's plots show how far the loaded ratio strays from the
quiet one (``ratio_stability.png``). The hog is ``python -c 'while True: pass'`` in a child
process that pins itself to one core (``os.sched_setaffinity``) before it starts spinning; it
is started before a case and stopped (terminated by its handle, never by name) after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import timing

SETTLE_S = 0.3  # after starting: the hog is spinning and the scheduler has placed it


def usable_cores() -> list[int]:
    """The cores this process may run on (all of them without an affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pick_core(wanted: int | None = None) -> int:
    """``wanted`` if this process may use it, else the last usable core (None: that one)."""
    cores = usable_cores()
    if wanted is None or wanted < 0:
        return cores[-1]
    if wanted not in cores:
        raise ValueError(f"--hog {wanted}: this process may use cores {cores}; expected one "
                         "of them (or --hog without a number for the last one).")
    return wanted


def hog_command(core: int) -> list[str]:
    """The hog: pins itself to ``core``, then spins (a pure-Python ``while True: pass``)."""
    code = (f"import os\nif hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {{{core}}})"
            "\nwhile True: pass\n")
    return [sys.executable, "-c", code]


class Hog:
    """Start and stop the busy loop; its pid and core for the record."""

    def __init__(self, core: int) -> None:
        self.core = core
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        if self.pid is not None:
            return
        self.proc = subprocess.Popen(hog_command(self.core), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        timing.SETTLE_IGNORED.add(self.proc.pid)  # the load is meant to stay: never waited for
        time.sleep(SETTLE_S)
        if self.proc.poll() is not None:
            raise RuntimeError(f"the CPU hog exited at once (code {self.proc.returncode}); "
                               f"run {hog_command(self.core)!r} to see why.")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        timing.SETTLE_IGNORED.discard(proc.pid)
        if proc.poll() is not None:
            return
        proc.terminate()  # our own child, by its handle
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    @contextmanager
    def running(self) -> Iterator[Hog]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def as_dict(self) -> dict[str, Any]:
        return {"core": self.core, "command": "python -c 'while True: pass', pinned with "
                f"os.sched_setaffinity to core {self.core}", "cores": usable_cores()}

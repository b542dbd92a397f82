"""The command line's manners: a closed pipe ends it quietly, and `info` lists the settings."""

from __future__ import annotations

import os
import subprocess
import sys


def test_closed_pipe_exits_quietly() -> None:
    """`portakern show attention --backend cuda | head -1`: the reader leaves early."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE, as after head -1 exits
    try:
        res = subprocess.run([sys.executable, "-m", "portakern.cli", "show", "attention",
                              "--backend", "cuda"], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(write)
    assert "BrokenPipe" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert res.stderr == "", res.stderr
    assert res.returncode == 141


def test_info_lists_every_setting() -> None:
    from portakern import settings

    res = subprocess.run([sys.executable, "-m", "portakern.cli", "info"], capture_output=True,
                         text=True, timeout=300, check=True)
    for name in settings.SETTINGS:
        assert name in res.stdout

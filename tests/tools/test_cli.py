"""The command line's manners: a closed pipe ends it quietly, and `info` lists the settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_closed_pipe_exits_quietly() -> None:
    """`portakern show attention --backend cuda | head -1`: the reader leaves early."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE, as after head -1 exits
    try:
        res = subprocess.run([sys.executable, "-m", "portakern.tools.cli", "show", "attention",
                              "--backend", "cuda"], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(write)
    assert "BrokenPipe" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert res.stderr == "", res.stderr
    assert res.returncode == 141


def test_info_lists_every_setting() -> None:
    from portakern.core import settings

    res = subprocess.run([sys.executable, "-m", "portakern.tools.cli", "info"], capture_output=True,
                         text=True, timeout=300, check=True)
    for name in settings.SETTINGS:
        assert name in res.stdout


def test_check_that_checks_nothing_does_not_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """Every result n/a (here: an op with an int32 table and no case generator) is not a pass:
    `portakern check` says NOTHING CHECKED and exits 1."""
    import portakern as pk
    from portakern.ops import get_op
    from portakern.tools.cli import main

    base = get_op("softmax")
    spec = base.replace(name="nothing_checkable", cases=None, shapes=None, example=None,
                        examples=None)
    pk.register_op(spec)
    try:
        rc = main(["check", "--ops", "nothing_checkable", "--backend", "numpy",
                   "--dtypes", "float32"])
    finally:
        pk.unregister_op("nothing_checkable")
    out = capsys.readouterr().out
    assert rc == 1 and "NOTHING CHECKED" in out and "passed" not in out.splitlines()[-1], out


def test_check_passes_on_every_kernel_target(kernel_target: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`portakern check` (the conformance run users start) on each C-kernel target of this
    machine: PoCL and Intel's CPU runtime where the set-up installed both. Every op and
    dtype, two random cases each; exit 0 and a PASS line, never NOTHING CHECKED."""
    from portakern.tools.cli import main

    rc = main(["check", "--backend", kernel_target, "--examples", "2", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "conformance: passed" in out and " 0 fail" in out, out
    assert "NOTHING CHECKED" not in out and " pass" in out, out

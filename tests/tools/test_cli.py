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


def test_check_names_with_spaces_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """`--dtypes "float32, float64"`: the CLI validated stripped names, the run looked up
    " float64" (n/a everywhere) and passed having never checked float64; `--ops "softmax,
    matmul"` crashed with a KeyError."""
    from portakern.tools.cli import main

    rc = main(["check", "--backend", "numpy", "--ops", "softmax, rmsnorm", "--dtypes",
               "float32, float64", "--examples", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("softmax", "rmsnorm"))]
    assert {(r[0], r[2], r[3]) for r in rows} == {
        (op, dt, "pass") for op in ("softmax", "rmsnorm") for dt in ("float32", "float64")}, out


def test_check_seed_reproduces_across_processes(tmp_path: object) -> None:
    """--seed gives the same cases in every process (hash(op) is salted per process) and
    different streams per dtype (len(dtype) is 7 for float16, float32 and float64)."""
    from pathlib import Path

    cases = []
    for salt in ("1", "2"):
        out = Path(str(tmp_path)) / f"o{salt}.json"
        subprocess.run([sys.executable, "-m", "portakern.tools.cli", "check", "--backend",
                        "numpy", "--ops", "matmul", "--dtypes", "float32,float64",
                        "--examples", "1", "--seed", "5", "--out", str(out)],
                       env={**os.environ, "PYTHONHASHSEED": salt}, capture_output=True,
                       text=True, timeout=300, check=True)
        import json

        res = json.loads(out.read_text())
        cases.append([r["case"] for r in res["results"]])
    assert cases[0] == cases[1]
    assert cases[0][0].split()[0] != cases[0][1].split()[0] or len(set(cases[0])) == 2

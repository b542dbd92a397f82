"""docs/add-a-kernel.md cannot rot: its Python blocks are extracted and run, in order, in one
namespace — defining, registering, running on every backend, checking and showing an op.

The op the tutorial registers is removed afterwards, so test files that compare the registry
with what they collected never see it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import portakern as pk

DOC = Path(__file__).resolve().parent.parent / "docs" / "add-a-kernel.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_ALIVE: list[object] = []


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a markdown text, in order."""
    return BLOCK.findall(text)


def test_the_tutorial_has_the_promised_parts() -> None:
    text = DOC.read_text()
    blocks = python_blocks(text)
    code = "\n".join(blocks)
    assert len(blocks) >= 6
    for needle in ("PK_KERNEL void swish(", "def semantics(xp", "def tolerance(",
                   "pk.register_op(SWISH, check=True)", '"check", "--ops", "swish"',
                   'show("swish"', "compare(SWISH"):
        assert needle in code, f"the tutorial lost {needle!r}"
    assert '[project.entry-points."portakern.ops"]' in text


def test_the_tutorial_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = "\n\n".join(python_blocks(DOC.read_text()))
    namespace: dict[str, object] = {"__name__": "add_a_kernel_tutorial"}
    _ALIVE.append(namespace)  # backends cache per id(spec): never let SWISH's id be reused
    try:
        exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own docs
        out = capsys.readouterr().out
        assert pk.ops.get_op("swish") is namespace["SWISH"]
        assert "spec 'swish_typo', field `schedules`" in out and "Fix:" in out
        assert "worst error/bound" in out and "numpy" in out
        assert "PK_KERNEL void swish(" in out and "__half" in out  # the shown CUDA source
        assert "swish_typo" not in pk.ops.OPS
    finally:
        pk.unregister_op("swish")

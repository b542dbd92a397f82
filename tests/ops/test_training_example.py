"""docs/training.md's training step cannot rot: its Python block runs as written (a tiny
transformer block trained with every op on jax:pallas, on jax, and in plain jax.numpy; the
block asserts the losses agree and fall)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def test_training_example_runs_and_the_losses_agree() -> None:
    pytest.importorskip("jax", reason="the example trains on jax")
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/training.md should hold one python block"
    namespace: dict = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)  # noqa: S102 - our own docs
    assert len(namespace["losses_pallas"]) == 3

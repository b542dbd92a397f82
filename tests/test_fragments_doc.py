"""docs/fragments.md cannot rot: its Python blocks (a user kernel written against the fragment
API, run on PoCL under each vendor's lane map and verified against the float64 oracle) are
extracted and run, in order, in one namespace."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tutorial import python_blocks

import portakern as pk
from portakern.runtime import selection

DOC = Path(__file__).resolve().parent.parent / "docs" / "fragments.md"
_ALIVE: list[object] = []  # backends cache per spec token: keep the example's spec alive


def test_the_fragment_page_example_runs(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        selection.get("opencl:pocl")
    except pk.PortakernError as exc:
        pytest.skip(f"opencl:pocl unavailable: {exc}")
    monkeypatch.setenv("PORTAKERN_MMA_LAYOUT", "sm80")  # restored after the doc deletes it
    code = "\n\n".join(python_blocks(DOC.read_text()))
    assert "PK_MMA_T(&c, &a, &b" in code and "pk_mma_load_a" in code
    namespace: dict[str, object] = {"__name__": "fragments_doc"}
    _ALIVE.append(namespace)
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own docs
    out = capsys.readouterr().out
    for layout in ("sm80", "cdna", "rdna3", "intel"):
        assert f"{layout} float16 True" in out and f"{layout} bfloat16 True" in out

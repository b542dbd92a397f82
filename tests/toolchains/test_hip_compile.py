"""AMD without a GPU: the hip dialect compiled by the installed hipcc for gfx targets.

CI installs hipcc (scripts/setup.sh: hipcc libamdhip64-dev rocm-device-libs). A missing
hipcc fails these tests when CI is set (a check that silently skips proves nothing) and
skips them elsewhere, naming the install command.

What runs here (hipcc takes 1-10 s per kernel on two cores, so CI compiles a subset; the full
set is `portakern check --backend hip --compile-only`, every representative problem on every
target the toolchain accepts): every op x dtype x schedule on gfx90a, and every op x dtype of
the GPU schedule on gfx906 and gfx1030, for each op's first representative problem.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re

import pytest

from portakern.core.errors import CompileError
from portakern.ops import get_op
from portakern.tools import compile_check

from conftest import require_tool

hip = importlib.import_module("portakern.toolchains.hipcc")
BUILTIN_OPS = ("matmul", "softmax", "rmsnorm", "attention")
DTYPES = ("float32", "float16", "bfloat16", "float64")


def need_hipcc() -> None:
    require_tool(hip.find_hipcc(), "hipcc is not installed; the AMD compile check needs it",
                 hip.INSTALL_FIX)


def _ci_cases() -> list[compile_check.CompileCase]:
    out = []
    for op in BUILTIN_OPS:
        for dt in DTYPES:
            first = {}
            for c in compile_check.cases(["gfx90a", "gfx906", "gfx1030"], [op], [dt], "hip"):
                first.setdefault((c.schedule, c.arch), c)  # the first problem of each
            out += [c for (sched, arch), c in first.items()
                    if arch == "gfx90a" or sched == "gpu"]
    return out


CASES = _ci_cases()


@pytest.fixture(scope="module")
def precompiled() -> None:
    """Compile every case once, in parallel (hipcc processes); the tests read the memo.
    Under pytest-xdist each worker compiles the cases it runs, as they come."""
    need_hipcc()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    compile_check.compile_cases(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compiles_with_hipcc(case: compile_check.CompileCase, precompiled: None) -> None:
    res = compile_check.compile_case(case)
    assert res.ok, f"{case.name} does not compile:\n{res.error}"
    assert res.ptx_bytes > 0 and res.kernels, "no code object or no kernel metadata"


def test_subset_covers_every_op_dtype_schedule() -> None:
    got = {(c.op, c.dtype, c.schedule, c.arch) for c in CASES}
    for op in BUILTIN_OPS:
        for dt in DTYPES:
            for sched in get_op(op).schedules:
                assert (op, dt, sched, "gfx90a") in got
            assert {(op, dt, "gpu", a) for a in ("gfx906", "gfx1030")} <= got


def test_options_are_hiprtcs_and_keep_the_numerics() -> None:
    opts = hip.compile_options()
    i = opts.index("-include")
    assert opts[i + 1] == "hip/hip_runtime.h"  # hipRTC's implicit include
    assert "-ffp-contract=fast" in opts and "-fno-fast-math" in opts
    assert "-fno-gpu-flush-denormals-to-zero" in opts
    assert not set(opts) & set(hip.FORBIDDEN_OPTIONS)


def test_broken_kernel_fails_with_log_and_numbered_source() -> None:
    need_hipcc()
    spec = get_op("softmax")
    _, prob = compile_check.representative_problems(spec, "float32")[0]
    src = spec.render("hip", prob, spec.config("gpu", None, prob))
    lines = [ln for ln in src.splitlines() if not ln.startswith("#define PK_BARRIER()")]
    broken = "\n".join(lines) + "\n"
    with pytest.raises(CompileError) as got:
        compile_check.compile_target_source(broken, "gfx90a", "softmax.hip", "hip")
    err = got.value
    msg = str(err)
    assert "PK_BARRIER" in err.log and "error" in err.log
    named = {int(n) for n in re.findall(r"softmax\.hip:(\d+):", err.log)}
    use = min(named)
    assert "--- compiler log ---" in msg and "--- rendered source ---" in msg
    assert re.search(rf"^\s*{use} \|.*PK_BARRIER\(\)", msg, re.M), "numbered source missing"
    assert "--offload-arch=gfx90a" in msg and "-fno-fast-math" in msg


def test_command_lists_targets_and_prints_the_table(tmp_path, capsys) -> None:  # noqa: ANN001
    need_hipcc()
    out = tmp_path / "hip.json"
    rc = compile_check.main(argparse.Namespace(backend=["hip"], ops="softmax",
                                               dtypes="float32", arch=["gfx90a"],
                                               out=str(out)))
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "targets accepted by this toolchain: gfx90a" in text
    assert re.search(r"^softmax\s+float32\s+gpu\s+\S+\s+ok$", text, re.M)
    import json

    data = json.loads(out.read_text())
    assert data["archs"] == ["gfx90a"] and {r["status"] for r in data["results"]} == {"ok"}
    assert data["results"][0]["kernels"][0]["kernel"] == "softmax"


def test_refused_target_is_listed_with_the_reason(capsys) -> None:  # noqa: ANN001
    need_hipcc()
    assert hip.probe_arch("gfx90a") == ""
    why = hip.probe_arch("gfx9999")
    assert why  # no such processor: refused, with clang's words
    rc = compile_check.main(argparse.Namespace(backend=["hip"], ops="softmax",
                                               dtypes="float32", arch=["gfx9999"], out=None))
    text = capsys.readouterr().out
    assert rc == 1 and "target gfx9999 not accepted (REQUIRED)" in text


def test_cli_routes_hip_compile_only(capsys) -> None:  # noqa: ANN001
    need_hipcc()
    from portakern.tools import cli

    rc = cli.main(["check", "--backend", "hip", "--compile-only", "--ops", "rmsnorm",
                   "--dtypes", "bfloat16", "--arch", "gfx1030"])
    assert rc == 0
    assert "gfx1030" in capsys.readouterr().out


def test_missing_hipcc_says_how_to_install(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv("PORTAKERN_HIPCC", "/nonexistent/hipcc")
    rc = compile_check.main(argparse.Namespace(backend=["hip"], ops=None, dtypes=None,
                                               arch=None, out=None))
    text = capsys.readouterr().out
    assert rc == 2 and "hipcc is not installed" in text and "apt-get install hipcc" in text


def test_arch_spellings() -> None:
    assert hip.normalize_arch("GFX90A") == "gfx90a"
    assert hip.normalize_arch("amdgcn-amd-amdhsa--gfx1030") == "gfx1030"
    with pytest.raises(Exception, match="gfx name"):
        hip.normalize_arch("mi200")

"""Ops own their metadata (issue 15, point 3): what the tools need to know about an op — the
compile checks' representative calls (``examples``), `portakern show`'s typical call and its
size names (``example(dtype, **sizes)``), the Pallas kernel's block tunables
(``PallasKernel``) — lives in the op's KernelSpec, in the same fields a user op fills. No tool
keeps a table keyed by op name, and a user op that fills a field gets it used.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.core.spec import ArrayMeta, PallasKernel, Tunable
from portakern.ops import attention, get_op
from portakern.tools import compile_check
from portakern.tools.show import representative_problem, show

ROOT = Path(__file__).resolve().parents[2] / "portakern"
BUILTIN_OPS = ("matmul", "softmax", "attention", "rmsnorm")
# modules that read per-op metadata from specs: they name no op
OP_BLIND = ("tools/compile_check.py", "tools/show.py", "backend/jax.py")


def _op_name_uses(path: Path, names: set[str]) -> list[str]:
    """Every string literal equal to one of ``names`` (a comparison operand, a dict key, a
    member of a tuple tested with ``in``, a ``.get`` argument...), and every comparison
    with a ``.name`` attribute (``spec.name == ...``); docstrings are prose, not literals."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                    ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in names and id(node) not in docstrings:
            found.append(f"{path.name}:{node.lineno}: literal {node.value!r}")
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Attribute) and side.attr == "name":
                    found.append(f"{path.name}:{node.lineno}: compares `.name`")
    return found


@pytest.mark.parametrize("module", OP_BLIND)
def test_tools_keep_no_table_keyed_by_op_name(module: str) -> None:
    names = set(BUILTIN_OPS)
    pallas = attention.SPEC.pallas
    assert isinstance(pallas, PallasKernel)
    if module.startswith("backend/"):  # nor the attention kernel's block names
        names |= {t.name for t in pallas.tunables} | set(pallas.aliases)
    assert _op_name_uses(ROOT / module, names) == []


def test_the_check_catches_a_returning_table(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""softmax in prose is fine."""\n'
                   'SIZES = {"matmul": {"M": 256}}\n'
                   'def f(spec):\n'
                   '    return spec.name == other or spec.name in ("attention",)\n')
    got = _op_name_uses(bad, set(BUILTIN_OPS))
    assert len(got) == 4 and "softmax" not in " ".join(got), got


def test_jax_backend_imports_no_op_module() -> None:
    tree = ast.parse((ROOT / "backend" / "jax.py").read_text())
    mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in mods if "ops" in m.split(".")], mods


# --- the built-in ops fill the fields ----------------------------------------------------
def test_builtin_ops_declare_their_representative_calls() -> None:
    for name in ("matmul", "softmax", "attention"):
        spec = get_op(name)
        assert spec.examples is not None and spec.example is not None, name
    labels = [lab for lab, _ in compile_check.representative_problems(get_op("attention"))]
    assert labels == ["gqa d64", "d40", "d80", "d111", "d128", "d64 mask causal"]
    # rmsnorm declares only `example`: the fallback, labelled 'example'
    (label, prob), = compile_check.representative_problems(get_op("rmsnorm"), "float16")
    assert label == "example" and prob.shapes["x"] == (64, 4096) and prob.dtype == "float16"


def test_show_sizes_come_from_the_spec_example() -> None:
    mm = representative_problem(get_op("matmul"), "float32")
    assert mm.shapes == {"a": (256, 256), "b": (256, 256)}
    assert representative_problem(get_op("matmul"), "float32", {"M": 7}).shapes["a"] == (7, 256)
    # a size name the example does not take is refused (it was ignored: `tune --shape m=16`
    # tuned and stored 256^3)
    with pytest.raises(pk.InvalidArgumentError, match="takes no such size"):
        representative_problem(get_op("matmul"), "float32", {"M": 7, "X": 3})
    assert representative_problem(get_op("softmax"), "float16").shapes["x"] == (64, 1024)
    att = get_op("attention")
    p = representative_problem(att, "float32")
    assert p.shapes["q"] == (1, 8, 128, 64) and p.shapes["mask"] is None
    assert representative_problem(att, "float32", {"D": 80}).shapes["v"] == (1, 8, 128, 80)
    assert representative_problem(att, "float32", {"D": 80, "Dv": 48}).shapes["v"][-1] == 48


@pytest.mark.parametrize("name", BUILTIN_OPS)
def test_builtin_examples_pass_the_registration_checks(name: str) -> None:
    """The same check a user op's example gets at register_op."""
    from portakern.core.spec_checks import check_spec, kernel_names

    spec = get_op(name)
    prob = representative_problem(spec, "float32")
    launched = {la.kernel for sched in spec.schedules
                for la in spec.launches(prob, spec.config(sched, None, prob))}
    assert launched <= set(kernel_names(spec.source)), (launched, kernel_names(spec.source))
    assert set(check_spec(spec)) == {"float32", "float16", "bfloat16", "float64"}


def test_entry_points_with_launch_bounds_are_found() -> None:
    """matmul and attention declare `PK_KERNEL PK_LAUNCH_BOUNDS(n, m) void name(`."""
    from portakern.core.spec_checks import kernel_names

    src = ("PK_KERNEL void plain(int n) {}\n"
           "PK_KERNEL PK_LAUNCH_BOUNDS(LX * LY, MM_MIN_GROUPS) void bounded(int n) {}\n"
           "PK_KERNEL  PK_LAUNCH_BOUNDS((BQ), 2)\nvoid nested (int n) {}\n"
           "static void helper(int n) {}\n")
    assert kernel_names(src) == ["plain", "bounded", "nested"]
    assert kernel_names(get_op("matmul").source) == ["matmul_pack_b", "matmul", "matmul_mma"]
    names = kernel_names(get_op("attention").source)  # later entry points may follow
    assert names[:3] == ["attention_pack_kv", "attention", "attention_combine"]


# --- a user op that fills the fields gets them used ---------------------------------------
def _user_examples(dtype: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [("tall", {"x": ArrayMeta((300, 17), dtype)}, {}),
            ("wide", {"x": ArrayMeta((3, 5000), dtype)}, {"axis": 0})]


def _user_example(dtype: str, *, rows: int = 5, n: int = 99
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"x": ArrayMeta((rows, n), dtype)}, {"axis": -1}


@pytest.fixture
def user_rows() -> Any:
    spec = get_op("softmax").replace(name="user_rows", examples=_user_examples,
                                     example=_user_example, doc="a user op")
    pk.register_op(spec)
    try:
        yield spec
    finally:
        pk.unregister_op("user_rows")


def test_compile_checks_render_a_user_ops_examples(user_rows: Any) -> None:
    probs = compile_check.representative_problems(user_rows, "float16")
    assert [(lab, p.shapes["x"], p.params["axis"]) for lab, p in probs] == [
        ("tall", (300, 17), 1), ("wide", (3, 5000), 0)]
    assert all(p.dtype == "float16" for _, p in probs)
    cases = compile_check.cases(["80"], ["user_rows"], ["float32"])
    assert {c.problem for c in cases} == {"tall", "wide"}
    assert all(c.source and c.error is None for c in cases)
    hip = compile_check.cases(["gfx90a"], ["user_rows"], ["float32"], "hip")
    assert {c.problem for c in hip} == {"tall", "wide"} and all(c.source for c in hip)


def test_without_examples_the_example_is_compiled(user_rows: Any) -> None:
    spec = user_rows.replace(examples=None)
    (label, prob), = compile_check.representative_problems(spec, "float32")
    assert label == "example" and prob.shapes["x"] == (5, 99)


def test_show_renders_a_user_ops_sized_example(user_rows: Any) -> None:
    assert representative_problem(user_rows, "float32").shapes["x"] == (5, 99)
    assert representative_problem(user_rows, "float32", {"n": 77}).shapes["x"] == (5, 77)
    with pytest.raises(pk.InvalidArgumentError, match="--shape zz"):
        representative_problem(user_rows, "float32", {"n": 77, "zz": 1})
    src = show("user_rows", "cuda", shape="rows=3,n=77")
    assert "groups=(3, 1, 1)" in src.splitlines()[1] and "value=77" in src.splitlines()[1]


def test_a_user_pallas_kernel_declares_its_blocks() -> None:
    """The jax:pallas path validates and passes a user kernel's own block tunables (and the
    C tunable aliased to one); it knows no op's names."""
    pytest.importorskip("jax")
    got: list[dict[str, int]] = []

    def build(problem: Any, interpret: bool, *, platform: str, reference: Any,
              **blocks: int) -> Any:
        got.append(dict(blocks))
        return reference

    kernel = PallasKernel(build, tunables=(Tunable("rows_per_step", (1, 2, 4)),),
                          aliases={"WG": "rows_per_step"})
    spec = get_op("softmax").replace(name="user_pallas", pallas=kernel)
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    want = pk.softmax(x, backend="numpy")
    np.testing.assert_allclose(pk.call(spec, x, backend="jax:pallas",
                                       config={"rows_per_step": 4}), want, rtol=1e-5)
    np.testing.assert_allclose(pk.call(spec, x, backend="jax:pallas", config={"WG": 2}), want,
                               rtol=1e-5)
    assert got == [{"rows_per_step": 4}, {"rows_per_step": 2}]
    with pytest.raises(pk.InvalidArgumentError, match=r"takes rows_per_step \(or WG\)"):
        pk.call(spec, x, backend="jax:pallas", config={"block_q": 64})
    with pytest.raises(pk.InvalidArgumentError, match="outside its domain"):
        pk.call(spec, x, backend="jax:pallas", config={"WG": 8})

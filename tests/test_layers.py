"""The layers (docs/architecture.md): core -> ops -> backends -> runtime -> tools.

Read from the source, not from a running process: every module's imports, function-level and
conditional ones included (``if TYPE_CHECKING:`` blocks excepted: they never run), must form no
cycle; no submodule imports the package ``portakern`` itself; the import-linter contracts in
pyproject.toml hold; and importing portakern plus one op call loads no tools module.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("portakern.tools.autotune", "portakern.tools.compile_check", "portakern.tools.resources",
         "portakern.tools.registration", "portakern.tools.cases", "portakern.tools.conformance",
         "portakern.tools.show",
         "portakern.tools.trace", "portakern.tools.bench", "portakern.tools.cli")


def _modules() -> dict[str, Path]:
    """Dotted name -> file."""
    out: dict[str, Path] = {}
    for p in (ROOT / "portakern").rglob("*.py"):
        parts = ("portakern", *p.relative_to(ROOT / "portakern").with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _nodes(tree: ast.AST):
    """Every node, skipping the bodies of ``if TYPE_CHECKING:`` (annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id",
                                                getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            for other in node.orelse:
                yield other
                yield from _nodes(other)
            continue
        yield node
        yield from _nodes(node)


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The portakern modules ``name`` imports anywhere in its source ('portakern' for the
    package itself)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "portakern")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "portakern":
                continue
            for a in node.names:
                full = f"{mod}.{a.name}"
                found.add(full if full in mods else mod)
    out = set()
    for dotted in found:
        while dotted not in mods and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        if dotted in mods and dotted != name:
            out.add(dotted)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


# None known: the simulator extends the OpenCL backend through hooks it registers itself
# (opencl.PROBE_HOOKS, SELECTOR_HOOKS), loaded by the registry as a companion module.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = [c for c in cycles if c not in KNOWN_CYCLES]
    detail = ["; ".join(f"{v} -> {sorted(graph[v] & set(c))}" for v in c) for c in cycles]
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(detail)


def test_no_submodule_imports_the_package() -> None:
    bad = sorted(m for m, deps in _graph().items() if m != "portakern" and "portakern" in deps)
    assert not bad, f"these import the package itself (use relative imports): {bad}"
    # an absolute `from portakern.core.errors import X` imports the package first, too: submodules
    # import each other relatively (function-level imports included)
    absolute = []
    for path in sorted((ROOT / "portakern").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in _nodes(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] == "portakern" for n in names):
                absolute.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not absolute, "absolute imports of portakern inside it:\n" + "\n".join(absolute)


def test_import_and_first_call_load_no_tool() -> None:
    code = ("import sys, numpy as np, portakern as pk\n"
            "pk.softmax(np.ones((2, 3), np.float32), backend='numpy')\n"
            "pk.softmax(np.ones((2, 3), np.float32))\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('portakern'))))\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert "portakern.ops.softmax" in got
    tools = [m for m in got if any(m == t or m.startswith(t + ".") for t in TOOLS)]
    assert not tools, f"import portakern + pk.softmax loaded tools modules: {tools}"


def test_import_linter_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) \
        or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' (scripts/setup.sh does)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


# the backends, and the compile-only toolchains (a `target.compiler == "hipcc"` is the same
# backend knowledge under another name: compile_only's records carry hooks instead)
BACKEND_NAMES = {"cuda", "hip", "opencl", "jax", "numpy", "nvrtc", "hipcc"}


def test_no_backend_name_comparisons_outside_backends() -> None:
    """Backend knowledge lives in backend/: no `x == "cuda"` or `x == "hipcc"` (or in/!=
    against a tuple of names, or a match case) anywhere else; differences are data (dialect
    tables, compile-only target records) or hooks."""
    found = []
    for path in sorted((ROOT / "portakern").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("portakern/backend/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            consts: list[ast.expr] = []
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    consts += side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) \
                        else [side]
            elif isinstance(node, ast.MatchValue):
                consts = [node.value]
            names = [c.value for c in consts
                     if isinstance(c, ast.Constant) and c.value in BACKEND_NAMES]
            if names:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "backend names compared outside backend/:\n" + "\n".join(found)


def test_backends_is_a_plain_function_beside_the_backend_package() -> None:
    """``pk.backends()`` is an ordinary function and the backends are the package
    ``portakern.backend``: no module whose class is swapped to make it callable, and every
    import form of a backend module works (``import a.b.c as x`` resolves ``a.b`` by
    attribute, which a same-named function would break)."""
    import importlib
    import types

    import portakern as pk

    assert isinstance(pk.backends, types.FunctionType) and "numpy" in pk.backends()
    backend_pkg = importlib.import_module("portakern.backend")
    assert type(backend_pkg) is types.ModuleType
    import portakern.backend.numpy as numpy_backend  # noqa: PLC0415 - the form under test

    assert numpy_backend.__name__ == "portakern.backend.numpy"
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("portakern"):
            assert type(mod) is types.ModuleType, f"{mod.__name__}: {type(mod)}"

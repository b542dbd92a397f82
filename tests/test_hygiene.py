"""Code hygiene the issue tracker asked for once and a test keeps (issue 15)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_class_names_are_unique_in_the_package() -> None:
    """Three classes were once named ``Case``: a reader (and an error message naming a class)
    could not tell them apart."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "portakern").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{rel}:{node.lineno}")
    clashes = {name: places for name, places in where.items() if len(places) > 1}
    assert not clashes, f"class names defined more than once: {clashes}"


# `# type: ignore[code]  # why`: the code, then a reason on the same line.
_IGNORE = re.compile(r"#\s*type:\s*ignore\b")
_IGNORE_WITH_REASON = re.compile(r"#\s*type:\s*ignore\[[\w\-]+(?:\s*,\s*[\w\-]+)*\]\s*#\s*\S")


def ignores_without_reason(text: str, name: str) -> list[str]:
    """The ``type: ignore`` comments of a source that lack a code or a reason."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and _IGNORE.search(tok.string) \
                and not _IGNORE_WITH_REASON.search(tok.string):
            out.append(f"{name}:{tok.start[0]}: {tok.string}")
    return out


def test_the_reason_check_tells_them_apart() -> None:
    assert ignores_without_reason("x = 1  # type: ignore\n", "a")
    assert ignores_without_reason("x = 1  # type: ignore[attr-defined]\n", "a")
    assert ignores_without_reason("x = 1  # type: ignore  # no code\n", "a")
    assert not ignores_without_reason("x = 1  # type: ignore[attr-defined]  # set by f()\n", "a")
    assert not ignores_without_reason("x = 1  # type: ignore[arg-type, misc]  # why\n", "a")
    assert not ignores_without_reason('s = "# type: ignore"\n', "a")  # a string, no comment


# Left for the engineer rewriting these files to give a reason (or remove); nothing is added.
PENDING_REASONS: set[tuple[str, str]] = set()  # none left


def test_every_type_ignore_says_why() -> None:
    """A bare ``# type: ignore`` hides every error of its line, for a reason nobody can read
    later: each names the error code it silences and says why on the same line."""
    bare = []
    for path in sorted((ROOT / "portakern").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        bare += [hit for hit in ignores_without_reason(path.read_text(), rel)
                 if (rel, hit.split(": ", 1)[1].strip()) not in PENDING_REASONS]
    assert not bare, "type: ignore without a code and a reason " \
                     "(write `# type: ignore[code]  # why`):\n" + "\n".join(bare)

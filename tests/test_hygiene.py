"""Code hygiene the issue tracker asked for once and a test keeps (issue 15)."""

from __future__ import annotations

import ast
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

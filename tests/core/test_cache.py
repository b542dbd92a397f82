"""The on-disk store (portakern.core.cache): integrity, atomicity, permissions and degradation.

Every test points PORTAKERN_CACHE_DIR at its own tmp_path, so none touches the user's cache.
The tests run as root here, where chmod does not stop writes, so "read-only" is simulated by
making os.replace fail and "uncreatable" by putting the cache under a regular file.
"""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from portakern.core import cache
from portakern.core.cache import CacheWarning, Store
from portakern.core.errors import InvalidArgumentError


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(d))
    return d


def _only_file(st: Store) -> Path:
    files = [p for p in st.path.iterdir() if p.suffix == ".json"]
    assert len(files) == 1, files
    return files[0]


def test_roundtrip_permissions_and_format(root: Path) -> None:
    st = Store("tuning/dev-0123456789abcdef")
    value = {"config": {"TM": 8}, "time_s": 1.5e-3, "note": "ünïcode", "list": [1, None, True]}
    assert st.put("matmul.float32.K4", value)
    assert st.get("matmul.float32.K4") == value
    assert st.get("missing") is None
    f = _only_file(st)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    for d in (root, root / "tuning", st.path):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    doc = json.loads(f.read_text())
    assert doc["format"] == cache.FORMAT and doc["version"] == cache.VERSION
    assert re.fullmatch(r"[0-9a-f]{64}", doc["sha256"])
    assert dict(st.items()) == {"matmul.float32.K4": value}
    assert not [p for p in st.path.iterdir() if p.name.startswith(".tmp")]


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PORTAKERN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # XDG: relative paths are invalid
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "portakern"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "portakern"
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"


def test_keys_cannot_escape_and_namespaces_are_checked(root: Path) -> None:
    st = Store("tuning")
    for key in ("../../etc/passwd", "/abs/path", "a\\b", "..", "x" * 500):
        assert st.put(key, 1)
        assert st.filename(key).parent == st.path
        assert st.get(key) == 1
    assert st.filename("a/b") != st.filename("a_b")  # the hash keeps sanitised keys apart
    for bad in ("../up", "/abs", "Upper", "", "a//b", "a/../b"):
        with pytest.raises(InvalidArgumentError, match="namespace"):
            Store(bad)


def test_values_must_be_plain_json(root: Path) -> None:
    st = Store("tuning")
    for bad in (float("nan"), float("inf"), {1, 2}, object(), b"bytes"):
        with pytest.raises(InvalidArgumentError, match="not plain JSON"):
            st.put("k", {"v": bad})


def test_truncated_file_is_discarded_and_rebuilt(root: Path) -> None:
    st = Store("tuning")
    st.put("k", {"config": {"TM": 8}})
    f = _only_file(st)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.warns(CacheWarning, match="not valid JSON"):
        assert st.get("k") is None
    assert not f.exists()  # discarded
    assert st.put("k", {"config": {"TM": 4}})  # rebuilt
    assert st.get("k") == {"config": {"TM": 4}}


def test_flipped_bytes_are_detected(root: Path) -> None:
    st = Store("tuning")
    st.put("k", {"config": {"TM": 8, "TN": 2}})
    f = _only_file(st)
    text = f.read_text()
    f.write_text(text.replace('"TM":8', '"TM":9'))  # still valid JSON, contents changed
    with pytest.warns(CacheWarning, match="sha256 does not match"):
        assert st.get("k") is None
    assert not f.exists()


@pytest.mark.parametrize("damage", ["wrong_hash", "wrong_version", "wrong_namespace",
                                    "wrong_key", "not_envelope", "nan", "binary", "deep"])
def test_damaged_envelopes_are_discarded(root: Path, damage: str) -> None:
    """Damaged entries are deleted (and rebuilt); one of another format version is valid for
    the portakern that wrote it (a cache shared by two versions) and is left alone: it was
    deleted, silently under `portakern info`."""
    st = Store("tuning")
    if damage == "wrong_key":  # the same value stored under another key: its hash is right
        st.put("other", {"v": 1})
        other = st.filename("other")
        doc_other = json.loads(other.read_text())
        other.unlink()
    st.put("k", {"v": 1})
    f = _only_file(st)
    doc = json.loads(f.read_text())
    if damage == "wrong_hash":
        doc["sha256"] = "0" * 64
    elif damage == "wrong_version":
        doc["version"] = 999
    elif damage == "wrong_namespace":
        doc["namespace"] = "other"
    elif damage == "wrong_key":  # a correct hash over another key: it must not answer for "k"
        assert doc_other["key"] == "other" and doc_other["sha256"] != doc["sha256"]
        doc = doc_other
    elif damage == "not_envelope":
        doc = [1, 2, 3]
    text = json.dumps(doc)
    if damage == "nan":
        text = text.replace('"v": 1', '"v": NaN')
    if damage == "deep":
        text = "[" * 100000 + "]" * 100000
    f.write_bytes(b"\xff\xfe\x00garbage" if damage == "binary" else text.encode())
    if damage == "wrong_version":  # another portakern's entry, in a shared cache: kept
        with pytest.warns(CacheWarning, match="skipped|ignored"):
            assert st.get("k") is None
        assert f.exists()
        return
    with pytest.warns(CacheWarning, match="discarded"):
        assert st.get("k") is None
    assert not f.exists()


def test_oversized_and_symlinked_files_are_not_read(root: Path, tmp_path: Path) -> None:
    st = Store("tuning")
    st.put("big", 1)
    st.put("link", 1)
    big = st.filename("big")
    big.write_bytes(b" " * (cache.MAX_FILE_BYTES + 1))
    with pytest.warns(CacheWarning, match="more than"):
        assert st.get("big") is None
    target = tmp_path / "elsewhere.json"
    target.write_text(st.filename("link").read_text())
    link = st.filename("link")
    link.unlink()
    link.symlink_to(target)
    with pytest.warns(CacheWarning, match="symbolic link"):
        assert st.get("link") is None
    assert target.exists()  # the link is removed, never what it points to


def test_uncreatable_directory_works_without_cache_and_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(blocker / "cache"))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for i in range(3):
            st = Store("tuning")
            assert st.put(f"k{i}", i) is False
            assert st.get(f"k{i}") is None
            assert list(st.items()) == []
    ours = [w for w in got if issubclass(w.category, CacheWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "continuing without a cache" in str(ours[0].message)
    assert "PORTAKERN_CACHE_DIR" in str(ours[0].message)


def test_read_only_directory_keeps_reads_and_warns_once(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = Store("tuning")
    assert st.put("old", {"v": 1})

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache.os, "replace", refuse)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for i in range(4):
            assert Store("tuning").put(f"new{i}", i) is False
    ours = [w for w in got if issubclass(w.category, CacheWarning)]
    assert len(ours) == 1 and "not writable" in str(ours[0].message)
    assert Store("tuning").get("old") == {"v": 1}  # reading still works
    assert not [p for p in st.path.iterdir() if p.name.startswith(".tmp")]  # no litter


def test_group_writable_directory_is_refused(root: Path) -> None:
    st = Store("tuning")
    st.put("k", 1)
    os.chmod(root, 0o777)
    with pytest.warns(CacheWarning, match="writable by other users"):
        assert Store("tuning").get("k") is None
    os.chmod(root, 0o700)
    assert Store("tuning").get("k") == 1


def test_clear_removes_everything(root: Path) -> None:
    a, b = Store("tuning/a"), Store("tuning/b")
    for i in range(3):
        a.put(f"k{i}", i)
        b.put(f"k{i}", i)
    (a.path / ".tmp-left-over.part").write_text("x")
    assert a.clear() == 3
    assert list(a.items()) == [] and len(list(b.items())) == 3
    assert Store("tuning").clear() == 3
    assert list(b.items()) == []


WRITER = """
import os, sys, time
from pathlib import Path
from portakern.core.cache import Store
worker, n, gate = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
(gate.parent / f"ready-{worker}").touch()
while not gate.exists():  # a barrier: every process starts writing at the same moment
    time.sleep(0.001)
st = Store("tuning/shared")
for i in range(n):
    assert st.put(f"w{worker}-k{i}", {"worker": worker, "i": i, "pad": "x" * 2000})
    assert st.put("contended", {"worker": worker, "i": i, "pad": "y" * 2000})
"""


def run_at_once(code: str, args: list[list[str]], tmp_path: Path) -> None:
    """Start one fresh interpreter per argument list, release them together, wait for all.

    Fresh interpreters (not fork) because this test process runs JAX and PoCL threads, and a
    forked child of a multithreaded process may deadlock."""
    gate = tmp_path / "gate" / "go"
    gate.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", code, *a, str(gate)], env=os.environ.copy())
             for a in args]
    deadline = time.monotonic() + 60
    while len(list(gate.parent.glob("ready-*"))) < len(procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.01)
    gate.touch()
    for p in procs:
        assert p.wait(60) == 0


def test_concurrent_writers_leave_a_valid_complete_store(root: Path, tmp_path: Path) -> None:
    workers, n = 4, 15
    run_at_once(WRITER, [[str(w), str(n)] for w in range(workers)], tmp_path)
    st = Store("tuning/shared")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # no entry may be damaged
        got = dict(st.items())
    assert set(got) == {f"w{w}-k{i}" for w in range(workers) for i in range(n)} | {"contended"}
    assert all(got[f"w{w}-k{i}"]["i"] == i for w in range(workers) for i in range(n))
    assert got["contended"]["worker"] in range(workers)
    assert not [p for p in st.path.iterdir() if not p.name.endswith(".json")]


def test_no_pickle_or_eval_in_cache_or_tuner() -> None:
    """Reading the cache must never run code: no pickle-like loader and no eval/exec anywhere in
    the code (the docstrings may say so; the AST is what is checked)."""
    banned = {"pickle", "cPickle", "marshal", "shelve", "dill", "eval", "exec", "__import__",
              "literal_eval", "yaml"}
    pkg = Path(cache.__file__).parents[1]
    # runtime/configs.py: the tuning database's reader; tools/autotune.py: the tuner
    for name in ("core/cache.py", "tools/autotune.py", "runtime/configs.py"):
        tree = ast.parse((pkg / name).read_text())
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Import):
                used.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                used.add((node.module or "").split(".")[0])
                used.update(a.name for a in node.names)
        assert not used & banned, f"{name} uses {sorted(used & banned)}"
        if name != "tools/autotune.py":  # the readers parse JSON; the tuner stores through them
            assert "json" in used


# --- issue 19: the store is portakern's alone ------------------------------------------------
def test_fifo_named_like_an_entry_is_skipped_not_waited_on(root: Path) -> None:
    """A FIFO where an entry belongs used to hang every op, `portakern info` and
    `tune --list` (the open waited for a writer). Run in a child with a timeout."""
    st = Store("tuning/dev")
    st.put("real", 1)
    fifo = st.filename("k")
    os.mkfifo(fifo)
    code = ("import warnings, sys; from portakern.core.cache import Store; "
            "warnings.simplefilter('always'); "
            "import io, contextlib; "
            "w = []; warnings.showwarning = lambda m, *a, **k: w.append(str(m)); "
            "s = Store('tuning/dev'); "
            "print(s.get('k'), sorted(k for k, _ in s.items()), "
            "any('not a regular file' in x for x in w))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PORTAKERN_CACHE_DIR": str(root)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "['real']", "True"], r.stdout
    assert fifo.exists()  # skipped, not deleted


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="chown to another user needs root")
def test_foreign_or_group_writable_entry_files_are_ignored(root: Path) -> None:
    st = Store("tuning/dev")
    st.put("a", 1)
    st.put("b", 2)
    os.chmod(st.filename("a"), 0o664)
    os.chown(st.filename("b"), 12345, -1)
    with pytest.warns(CacheWarning) as rec:
        assert Store("tuning/dev").get("a") is None
        assert Store("tuning/dev").get("b") is None
    text = " ".join(str(w.message) for w in rec)
    assert "writable by other users" in text and "another user" in text
    assert st.filename("a").exists() and st.filename("b").exists()


def test_group_writable_entry_file_is_ignored_without_root(root: Path) -> None:
    st = Store("tuning/dev2")
    st.put("a", 1)
    os.chmod(st.filename("a"), 0o666)
    with pytest.warns(CacheWarning, match="writable by other users"):
        assert Store("tuning/dev2").get("a") is None
    assert st.filename("a").exists()


def test_clear_removes_only_what_portakern_wrote(root: Path, tmp_path: Path) -> None:
    """`tune --clear` used to delete everything under the tuning directory, follow a
    symlinked directory into its target, and report 0. Now: entries by name and envelope."""
    st = Store("tuning/dev")
    st.put("k1", 1)
    st.put("k2", 2)
    mine = [st.filename("k1"), st.filename("k2")]
    theirs = st.path / "notes.txt"
    theirs.write_text("a user's file")
    lookalike = st.path / "x-0123456789abcdef.json"  # named like an entry, not one
    lookalike.write_text('{"hello": 1}')
    outside = tmp_path / "project"
    outside.mkdir()
    (outside / "data-0123456789abcdef.json").write_text("precious")
    (st.path.parent / "linked").symlink_to(outside, target_is_directory=True)
    removed, left = Store("tuning").clear_report()
    assert set(mine) <= set(removed)
    assert theirs.exists() and lookalike.exists()
    assert (outside / "data-0123456789abcdef.json").read_text() == "precious"
    assert (st.path.parent / "linked").is_symlink()
    reasons = {p.name: why for p, why in left}
    assert "notes.txt" in reasons and "x-0123456789abcdef.json" in reasons
    assert "symbolic link" in reasons["linked"]


def test_clear_does_not_follow_a_symlinked_namespace(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.json").write_text("{}")
    root.mkdir(mode=0o700)
    (root / "tuning").symlink_to(target, target_is_directory=True)
    removed, left = Store("tuning").clear_report()
    assert removed == [] and (target / "keep.json").exists()
    assert left and "symbolic link" in left[0][1]


def test_no_home_and_no_passwd_entry_falls_back_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from portakern.core import cache

    # a temporary directory of its own: the warning is given once per process and directory
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("PORTAKERN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(cache.Path, "home", staticmethod(no_home))
    with pytest.warns(CacheWarning, match="no home directory"):
        got = cache.cache_root()
    assert str(got).startswith(tempfile.gettempdir()) and "portakern-cache" in str(got)


def test_tune_clear_reports_removed_and_left(root: Path, capsys: pytest.CaptureFixture) -> None:
    from portakern.tools.cli import main

    st = Store("tuning/opencl-0123456789abcdef")
    st.put("softmax.x.y", {"a": 1})
    (st.path / "mine.txt").write_text("keep")
    assert main(["tune", "--clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 tuned entry" in out and "left 1 path" in out and "mine.txt" in out
    assert (st.path / "mine.txt").read_text() == "keep"



@pytest.mark.parametrize("setting", ["cache_dir", "opencl_cache", "neither"])
def test_cache_dir_governs_the_opencl_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            setting: str) -> None:
    """PORTAKERN_CACHE_DIR is the root of every portakern cache, PyOpenCL's compiled programs
    included (<root>/pyopencl, not ~/.cache/pyopencl); PORTAKERN_OPENCL_CACHE still wins.
    Checked as the cache_dir a build hands PyOpenCL: PyOpenCL keeps no files of its own for
    PoCL or NVIDIA, whose drivers cache builds themselves."""
    from portakern.backend.opencl import OpenCLBackend, cl
    from portakern.runtime import selection

    if not OpenCLBackend.probe().available:
        pytest.skip(f"opencl: {OpenCLBackend.probe().reason}")
    be = selection.get("opencl")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PORTAKERN_CACHE_DIR", raising=False)
    monkeypatch.delenv("PORTAKERN_OPENCL_CACHE", raising=False)
    if setting != "neither":
        monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path / "root"))
    if setting == "opencl_cache":
        monkeypatch.setenv("PORTAKERN_OPENCL_CACHE", str(tmp_path / "own"))
    seen = []
    real = cl.Program.build

    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("cache_dir"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cl.Program, "build", build)
    got = be.compile("__kernel void k(__global float *x) { x[0] = 1.0f; }", ("k",))
    assert set(got) == {"k"} and len(seen) == 1
    want = {"cache_dir": str(tmp_path / "root" / "pyopencl"),
            "opencl_cache": str(tmp_path / "own"), "neither": None}[setting]
    assert seen[0] == want

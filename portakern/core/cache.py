"""A small, safe on-disk key-value store for portakern's own files (the tuning database now,
compiled-kernel metadata later).

Why it looks the way it does:

* **Where**: ``$PORTAKERN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/portakern`` (an absolute
  ``XDG_CACHE_HOME`` only, as the XDG spec demands), else ``~/.cache/portakern``. Each user of
  the store gets a *namespace*, a sub-directory such as ``tuning/<device>``.
* **Permissions**: directories we create are 0700, files 0600 — tuning data says which devices
  and drivers a user has, and nobody else should be able to plant entries. A directory that
  another user owns or that is group/world-writable is refused (like ssh's StrictModes).
* **JSON only**: never pickle, marshal or eval — reading a cache file must never run code.
  Payloads are canonical JSON (sorted keys, no NaN/Infinity), at most ``MAX_FILE_BYTES``.
* **Integrity**: every file is an envelope ``{"format", "version", "namespace", "key",
  "sha256", "payload"}``; the sha256 covers the canonical form of everything but itself. A
  truncated, bit-flipped or mismatched file is detected, discarded with a ``CacheWarning`` and
  rebuilt by the next write. The hash catches accidents, not attackers (anyone who can write
  the file can recompute it), which is why every *consumer* validates what it reads as well —
  the tuner passes every value through ``KernelSpec.config``.
* **One file per key, atomic replace** — chosen over one merged file guarded by an
  ``fcntl.flock`` lock: a write is ``mkstemp`` in the same directory + ``os.replace``, which is
  atomic on POSIX and Windows, so a reader sees the old entry or the new one, never half of
  one; two processes writing different keys never touch the same file, and two writing the
  same key leave one complete winner. No lock means nothing to go stale after a crash, no
  dependence on advisory locking (absent or broken on some network filesystems, missing on
  Windows), and a corrupt file costs one entry, not the whole database. The price is one small
  file per entry, which is nothing for a tuning database.
* **Degrade, never fail**: a cache directory that cannot be created makes the store a no-op;
  one that cannot be written keeps reads working. Either case warns ONCE per process and
  directory; portakern itself keeps working, only without remembering.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import settings
from .errors import InvalidArgumentError

FORMAT = "portakern-cache"
VERSION = 1
OTHER_VERSION = "it has format version"
MAX_FILE_BYTES = 1 << 20  # no legitimate entry comes near this; bigger means damage or abuse
ENV_DIR = "PORTAKERN_CACHE_DIR"
SUFFIX = ".json"

_NAMESPACE_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}(/[a-z0-9][a-z0-9_.-]{0,63}){0,3}$")
_SLUG_RE = re.compile(r"[^A-Za-z0-9_.-]+")

_WARNED: set[tuple[str, str]] = set()
_WARN_LOCK = threading.Lock()


class CacheWarning(UserWarning):
    """portakern's cache could not be used as it should (and portakern carried on without it)."""


def cache_root() -> Path:
    """The directory portakern keeps its files under (not created here).

    Without ``$HOME`` and without a passwd entry for this uid (a container run with an
    arbitrary uid) there is no home directory: then a private directory under the system
    temporary directory, ``portakern-cache-<uid>``, with one CacheWarning saying so."""
    env = settings.cache.dir
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "portakern"
    try:
        return Path.home() / ".cache" / "portakern"
    except (RuntimeError, KeyError, OSError):  # no HOME and no passwd entry
        uid = os.getuid() if _has_uid() else "user"
        root = Path(tempfile.gettempdir()) / f"portakern-cache-{uid}"
        warn_once(root, "nohome",
                  f"portakern: no home directory ($HOME is unset and uid {uid} has no passwd "
                  f"entry); caching under {root} instead. Fix: set {ENV_DIR} (or HOME or "
                  "XDG_CACHE_HOME) to a private, writable directory.")
        return root


def warn_once(root: Path | str, kind: str, message: str) -> None:
    """Warn about a cache directory problem once per process, directory and kind: a cache that
    cannot be written would otherwise repeat its warning on every call."""
    tag = (str(root), kind)
    with _WARN_LOCK:
        if tag in _WARNED:
            return
        _WARNED.add(tag)
    warnings.warn(message, CacheWarning, stacklevel=3)


def canonical(obj: Any) -> str:
    """The one JSON text of a value that the integrity hash is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def _digest(namespace: str, key: str, payload: Any) -> str:
    body = canonical({"format": FORMAT, "version": VERSION, "namespace": namespace, "key": key,
                      "payload": payload})
    return hashlib.sha256(body.encode("ascii")).hexdigest()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in a cache file")


def _has_uid() -> bool:
    return hasattr(os, "getuid")


def _file_trust_problem(st: os.stat_result) -> str | None:
    """Why an entry file must not be read (None = fine): it is not a regular file, or another
    user owns it, or others may write it (anyone who can write it can plant a schedule)."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if _has_uid():
        if st.st_uid not in (os.getuid(), 0):
            return f"it belongs to another user (uid {st.st_uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"it is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_ENTRY_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,80}-[0-9a-f]{16}\.json$")
_TEMP_NAME_RE = re.compile(r"^\.tmp-[A-Za-z0-9_-]+\.part$")


def _trust_problem(path: Path, st: os.stat_result) -> str | None:
    """Why a directory must not be trusted with our files (None = fine)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if _has_uid():
        if st.st_uid not in (os.getuid(), 0):
            return f"{path} belongs to another user (uid {st.st_uid})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class Store:
    """Key -> JSON value, one integrity-checked file per key under ``cache_root()/namespace``.

    ``get`` returns None for anything missing, unreadable or invalid (warning for damage);
    ``put`` returns False when the value could not be saved (warning once). Neither raises for
    a filesystem problem: a cache must never be the reason a computation fails.
    """

    def __init__(self, namespace: str, root: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise InvalidArgumentError(
                f"cache namespace {namespace!r} is invalid; expected lower-case path parts of "
                "[a-z0-9_.-] separated by '/', e.g. 'tuning/opencl-1a2b'.")
        self.namespace = namespace
        self.root = Path(root) if root is not None else cache_root()
        self.path = self.root.joinpath(*namespace.split("/"))
        self._usable: bool | None = None  # None = not checked yet

    # --- directory ---------------------------------------------------------------------
    def _ensure_dir(self, create: bool) -> bool:
        """Make sure the namespace directory exists (0700) and can be trusted."""
        if self._usable:
            return True
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if not create:
                return False
            try:
                self._make_dirs()
                st = os.stat(self.path)
            except OSError as exc:
                warn_once(self.root, "uncreatable",
                          f"portakern cache directory {self.path} cannot be created "
                          f"({exc.strerror or exc}); continuing without a cache. Fix: set "
                          f"{ENV_DIR} to a writable directory.")
                self._usable = False
                return False
        except OSError as exc:  # e.g. a path component is a regular file
            warn_once(self.root, "uncreatable",
                      f"portakern cache directory {self.path} cannot be used "
                      f"({exc.strerror or exc}); continuing without a cache. Fix: set "
                      f"{ENV_DIR} to a writable directory.")
            self._usable = False
            return False
        why = _trust_problem(self.path, st)
        if why is None:
            why = next((w for w in (self._trust_of(p) for p in self._owned_parents()) if w), None)
        if why is not None:
            warn_once(self.root, "untrusted",
                      f"portakern cache directory refused: {why}; continuing without a cache. "
                      f"Fix: chmod 700 the directory, or set {ENV_DIR} to a private directory.")
            self._usable = False
            return False
        self._usable = True
        return True

    def _owned_parents(self) -> list[Path]:
        """The directories between the cache root and the namespace directory (ours to check)."""
        out, p = [self.root], self.path.parent
        while p != self.root and self.root in p.parents:
            out.append(p)
            p = p.parent
        return out

    @staticmethod
    def _trust_of(p: Path) -> str | None:
        try:
            return _trust_problem(p, os.stat(p))
        except OSError as exc:
            return f"{p} cannot be inspected ({exc.strerror or exc})"

    def _make_dirs(self) -> None:
        """Create missing directories 0700 (chmod after mkdir: the umask can't widen it, but an
        explicit mode states the intent and fixes a umask of 0)."""
        missing: list[Path] = []
        p = self.path
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue  # another process won the race; it created it 0700 as well
            os.chmod(d, 0o700)

    # --- files -------------------------------------------------------------------------
    def filename(self, key: str) -> Path:
        """A readable, safe file name for a key: a slug of it plus a hash of all of it, so no
        key can name a path outside the directory (no '/', no '..') and none collide."""
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"cache key must be a non-empty string; got {key!r}.")
        slug = _SLUG_RE.sub("_", key).strip("._")[:80] or "key"
        h = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return self.path / f"{slug}-{h}{SUFFIX}"

    def get(self, key: str) -> Any | None:
        """The stored value for ``key``, or None (missing, unreadable, or discarded as damaged)."""
        path = self.filename(key)
        if not self._ensure_dir(create=False):
            return None
        got = self._read(path)
        if got is None:
            return None
        if got[0] != key:
            self._discard(path, f"it holds key {got[0]!r}, not {key!r}")
            return None
        return got[1]

    def _read(self, path: Path) -> tuple[str, Any] | None:
        """(key, payload) of one file after every check, or None (damaged files discarded)."""
        # O_NOFOLLOW: never through a symlink; O_NONBLOCK: opening a FIFO (or a device) named
        # like an entry returns at once instead of waiting forever for a writer
        flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_BINARY", 0))
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._skip(path, "it is a symbolic link")
            else:
                self._skip(path, f"it cannot be opened ({exc.strerror or exc})")
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                why = _file_trust_problem(st)
                if why is not None:
                    self._skip(path, why)
                    return None
                if st.st_size > MAX_FILE_BYTES:
                    self._discard(path, f"it is {st.st_size} bytes, more than {MAX_FILE_BYTES}")
                    return None
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError:
            return None
        why, key, payload = self._decode(raw)
        if why is not None:
            if why.startswith(OTHER_VERSION):  # another portakern's entry: not ours to delete
                self._skip(path, why)
            else:
                self._discard(path, why)
            return None
        return key, payload

    # (the start of _decode's reason for an entry of another format version: such a file is
    # valid for the portakern that wrote it, so it is skipped, never deleted)
    def _decode(self, raw: bytes) -> tuple[str | None, str, Any]:
        """(problem, key, payload): validate the envelope and its hash."""
        if len(raw) > MAX_FILE_BYTES:
            return "it is too large", "", None
        try:
            doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            return f"it is not valid JSON (truncated or corrupted: {exc})", "", None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            return "it is not a portakern cache file", "", None
        if doc.get("version") != VERSION:
            return (f"{OTHER_VERSION} {doc.get('version')!r}, expected {VERSION} (another "
                    "portakern version sharing the cache)", "", None)
        key, payload, digest = doc.get("key"), doc.get("payload"), doc.get("sha256")
        if not isinstance(key, str) or not isinstance(digest, str) or "payload" not in doc:
            return "its envelope lacks key, payload or sha256", "", None
        if doc.get("namespace") != self.namespace:
            return f"it belongs to namespace {doc.get('namespace')!r}", "", None
        try:
            want = _digest(self.namespace, key, payload)
        except ValueError as exc:
            return f"its payload cannot be hashed ({exc})", "", None
        if digest != want:
            return "its sha256 does not match its contents (corrupted)", "", None
        return None, key, payload

    def _skip(self, path: Path, why: str) -> None:
        """Ignore a file that is not (or may not be) ours, with a warning; never delete it."""
        warn_once(path, "skipped",
                  f"portakern cache: ignored {path} because {why}; it is left as it is. Fix: "
                  "remove it yourself if it is not needed, or point "
                  f"{ENV_DIR} at a private directory.")

    def _discard(self, path: Path, why: str) -> None:
        warnings.warn(f"portakern cache: discarded {path} because {why}; it will be rebuilt.",
                      CacheWarning, stacklevel=4)
        try:
            os.unlink(path)
        except OSError:
            pass

    def put(self, key: str, value: Any) -> bool:
        """Store a JSON value atomically; False (after one warning) if it could not be saved."""
        path = self.filename(key)
        try:
            doc = {"format": FORMAT, "version": VERSION, "namespace": self.namespace, "key": key,
                   "sha256": _digest(self.namespace, key, value), "payload": value}
            text = canonical(doc)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"cache value for {key!r} is not plain JSON ({exc}); expected dicts, lists, "
                "strings, finite numbers, booleans and None.") from None
        data = text.encode("ascii")
        if len(data) > MAX_FILE_BYTES:
            raise InvalidArgumentError(f"cache value for {key!r} is {len(data)} bytes; the "
                                       f"limit is {MAX_FILE_BYTES}. Store less.")
        if not self._ensure_dir(create=True):
            return False
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-", suffix=".part")
            with os.fdopen(fd, "wb") as f:
                if hasattr(os, "fchmod"):
                    os.fchmod(f.fileno(), 0o600)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            return True
        except OSError as exc:
            warn_once(self.root, "unwritable",
                      f"portakern cache directory {self.path} is not writable "
                      f"({exc.strerror or exc}); results are not saved. Fix: make it writable or "
                      f"set {ENV_DIR} to a writable directory.")
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def items(self) -> Iterator[tuple[str, Any]]:
        """Every valid (key, value) in this namespace (damaged files are discarded on the way)."""
        if not self._ensure_dir(create=False):
            return
        try:
            names = sorted(os.listdir(self.path))
        except OSError:
            return
        for name in names:
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue
            path = self.path / name
            got = self._read(path)
            if got is None:
                continue
            if self.filename(got[0]) != path:
                self._discard(path, f"its key {got[0]!r} does not belong to this file name")
                continue
            yield got

    def clear(self) -> int:
        """Remove this namespace's entries (see ``clear_report``); returns how many."""
        return sum(1 for p in self.clear_report()[0] if p.name.endswith(SUFFIX))

    def clear_report(self) -> tuple[list[Path], list[tuple[Path, str]]]:
        """Remove what portakern wrote under this namespace, and nothing else.

        Removed: regular files named like an entry whose envelope is a valid portakern entry
        of the namespace and key they are filed under, our leftover temp files, and then the
        namespace directories this emptied. Left (with why): everything else — files of other
        programs, symlinks (never followed, never removed), FIFOs, damaged files, and any
        directory that is a symlink or not ours. Returns (removed, left)."""
        removed: list[Path] = []
        left: list[tuple[Path, str]] = []
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return removed, left
        except OSError as exc:
            return removed, [(self.path, f"cannot be inspected ({exc.strerror or exc})")]
        if stat.S_ISLNK(st.st_mode):
            return removed, [(self.path, "it is a symbolic link (not followed)")]
        why = _trust_problem(self.path, st)
        if why is not None:
            return removed, [(self.path, why)]
        self._clear_dir(self.path, self.namespace, removed, left)
        return removed, left

    def _clear_dir(self, path: Path, namespace: str, removed: list[Path],
                   left: list[tuple[Path, str]]) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            left.append((path, f"cannot be listed ({exc.strerror or exc})"))
            return
        for e in entries:
            p = Path(e.path)
            try:
                if e.is_symlink():
                    left.append((p, "symbolic link (not followed)"))
                    continue
                if e.is_dir(follow_symlinks=False):
                    sub = f"{namespace}/{e.name}"
                    if not _NAMESPACE_RE.match(sub):
                        left.append((p, "directory not named like a portakern namespace"))
                        continue
                    self._clear_dir(p, sub, removed, left)
                    try:
                        os.rmdir(p)  # only if now empty
                        removed.append(p)
                    except OSError:
                        pass
                    continue
                if not e.is_file(follow_symlinks=False):
                    left.append((p, "not a regular file"))
                    continue
                if _TEMP_NAME_RE.match(e.name):
                    os.unlink(p)
                    removed.append(p)
                    continue
                why = self._not_our_entry(p, namespace)
                if why is not None:
                    left.append((p, why))
                    continue
                os.unlink(p)
                removed.append(p)
            except OSError as exc:
                left.append((p, f"cannot be removed ({exc.strerror or exc})"))

    def _not_our_entry(self, path: Path, namespace: str) -> str | None:
        """None when ``path`` is an entry portakern wrote: the name, then the envelope."""
        if not _ENTRY_NAME_RE.match(path.name):
            return "not named like a portakern entry"
        flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_BINARY", 0))
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            return f"cannot be opened ({exc.strerror or exc})"
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file"
            raw = f.read(MAX_FILE_BYTES + 1)
        try:
            other = Store(namespace, self.root)
        except InvalidArgumentError:
            return "not in a portakern namespace"
        why, key, _ = other._decode(raw)
        if why is not None:
            return f"not a portakern entry: {why}"
        if other.filename(key) != path:
            return "its key does not belong to this file name"
        return None

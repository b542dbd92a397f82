"""Every ``PORTAKERN_*`` environment variable, declared once as a typed attribute (a *knob*).

The knobs are grouped by topic, in the style of Triton's ``triton/knobs.py``::

    from portakern.core import settings
    settings.cache.dir            # $PORTAKERN_CACHE_DIR: str | None
    settings.opencl.pool          # $PORTAKERN_OPENCL_POOL: bool
    settings.kernels.cache_size   # $PORTAKERN_KERNEL_CACHE_SIZE: int

Reading an attribute reads the environment at that moment (nothing is cached), so a test's
``monkeypatch.setenv`` or a user's ``os.environ[...] = ...`` takes effect at once. The class
attribute is the knob itself, for its metadata: ``settings.Cache.dir.env``, ``.kind``,
``.default``, ``.doc``, ``.text()`` (the variable's text). Knobs are read-only: set the
variable instead. "Off" is spelled one way for every switch: 0, off, no, false or none (any
case). ``SETTINGS`` maps each variable's name to its knob; `portakern info` lists them all.

``get(name)`` and ``raw(name)`` read a knob by its variable's name: the one internal,
low-level reader, kept for the modules not yet migrated to the attributes (and for code that
must tell "unset" from "off"); new code reads the attributes. ``watcher(name)`` is the
per-call dispatch path's cheap reader of one variable.

Core layer: imports nothing of portakern, so every layer may read a setting.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, NamedTuple, NoReturn, TypeVar, overload

OFF = ("0", "off", "no", "false", "none")

T = TypeVar("T")


def is_off(text: str | None) -> bool:
    """Whether a value says off (0, off, no, false, none; any case, spaces ignored)."""
    return text is not None and text.strip().lower() in OFF


def _text(env: str) -> str | None:
    text = os.environ.get(env)
    return text.strip() if text is not None and text.strip() else None


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


# --- the knobs ----------------------------------------------------------------------------
class Knob(Generic[T]):
    """One environment variable as a typed, read-only attribute of a settings group.

    ``env``: the variable; ``kind``: how its text is read; ``default``: the value when it is
    unset, blank or malformed; ``doc``: what it means (also the attribute's ``__doc__``).
    ``path`` is where it lives (``"cache.dir"``), set when its group class is made."""

    kind: ClassVar[str] = "str"

    def __init__(self, env: str, default: T, doc: str) -> None:
        if not env.startswith("PORTAKERN_"):
            raise ValueError(f"{env}: a portakern setting's variable starts with PORTAKERN_")
        self.env = env
        self.default = default
        self.doc = doc
        self.__doc__ = f"${env} ({self.kind}): {doc}"
        self.attr = ""
        self.path = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr
        self.path = f"{getattr(owner, 'topic', owner.__name__.lower())}.{attr}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Knob[T]: ...
    @overload
    def __get__(self, obj: Group, owner: type | None = None) -> T: ...
    def __get__(self, obj: Group | None, owner: type | None = None) -> Knob[T] | T:
        return self if obj is None else self.value()

    def __set__(self, obj: Group, value: object) -> NoReturn:
        raise AttributeError(f"settings.{self.path} is read from ${self.env}; set that "
                             "environment variable instead")

    def text(self) -> str | None:
        """The variable's text now, stripped; None when unset or blank."""
        return _text(self.env)

    def value(self) -> T:
        """The typed value now: the default when unset, blank or malformed."""
        text = _text(self.env)
        return self.default if text is None else self.parse(text)

    def parse(self, text: str) -> T:
        """The typed value of a non-blank text (the default where it is malformed)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} settings.{self.path} = ${self.env}>"


class Text(Knob[str | None]):
    """Free text (stripped); default None."""

    kind = "str"

    def __init__(self, env: str, doc: str) -> None:
        super().__init__(env, None, doc)

    def parse(self, text: str) -> str | None:
        return text


class FilePath(Knob[str | None]):
    """A file or directory (``~`` expanded); default None."""

    kind = "path"

    def __init__(self, env: str, doc: str) -> None:
        super().__init__(env, None, doc)

    def parse(self, text: str) -> str | None:
        return os.path.expanduser(text)


class PathOrOff(FilePath):
    """A directory, or a switch that turns the feature off: None both when unset and when
    off (``text()`` tells them apart)."""

    kind = "path|off"

    def parse(self, text: str) -> str | None:
        return None if is_off(text) else os.path.expanduser(text)


class Count(Knob[int]):
    """A positive integer; the default where the text is not one."""

    kind = "int"

    def parse(self, text: str) -> int:
        value = _positive_int(text)
        return self.default if value is None else value


class OptionalCount(Knob[int | None]):
    """A positive integer, or None (unset, malformed): the caller then decides."""

    kind = "int"

    def __init__(self, env: str, doc: str) -> None:
        super().__init__(env, None, doc)

    def parse(self, text: str) -> int | None:
        return _positive_int(text)


class Switch(Knob[bool]):
    """On unless off (0, off, no, false, none); default on."""

    kind = "switch"

    def __init__(self, env: str, doc: str, default: bool = True) -> None:
        super().__init__(env, default, doc)

    def parse(self, text: str) -> bool:
        return not is_off(text)


class Choice(Knob[str]):
    """One of ``choices`` (any case); "off" for any spelling of off; else the default."""

    kind = "choice"

    def __init__(self, env: str, default: str, choices: tuple[str, ...], doc: str) -> None:
        super().__init__(env, default, doc)
        self.choices = choices

    def parse(self, text: str) -> str:
        if is_off(text):
            return "off"
        low = text.lower()
        return low if low in self.choices else self.default


class StrictChoice(Knob[str]):
    """One of ``choices`` (any case); the default when unset or blank. Any other text is an
    error (InvalidArgumentError naming the variable, the text and the choices), never a
    silent default: a test run that means one lane map must not run another."""

    kind = "choice"

    def __init__(self, env: str, default: str, choices: tuple[str, ...], doc: str) -> None:
        super().__init__(env, default, doc)
        self.choices = choices

    def parse(self, text: str) -> str:
        low = text.lower()
        if low in self.choices:
            return low
        from .errors import InvalidArgumentError  # core: a sibling module, imported late

        raise InvalidArgumentError(
            f"${self.env}={text!r} is not one of {', '.join(self.choices)}. Fix: set it to "
            f"one of them (e.g. {self.env}={self.choices[0]}), or unset it for "
            f"{self.default}.")


class Group:
    """A topic's knobs, as class attributes; the one instance of each is a module attribute
    named after its ``topic``."""

    __slots__ = ()
    topic: ClassVar[str]

    @classmethod
    def knobs(cls) -> Iterator[Knob[Any]]:
        """This group's knobs, in declaration order."""
        for value in vars(cls).values():
            if isinstance(value, Knob):
                yield value

    def __repr__(self) -> str:
        shown = ", ".join(f"{k.attr}={k.value()!r}" for k in self.knobs())
        return f"settings.{self.topic}({shown})"


# --- the groups ---------------------------------------------------------------------------
class Selection(Group):
    """Which backend a call runs on."""

    __slots__ = ()
    topic = "selection"
    backend = Text(
        "PORTAKERN_BACKEND",
        "the backend selector a call uses when neither backend= nor portakern.use() says "
        "(e.g. opencl, cuda:1, jax:pallas); unset: the automatic choice")


class Cache(Group):
    """Where portakern keeps files on disk."""

    __slots__ = ()
    topic = "cache"
    dir = FilePath(
        "PORTAKERN_CACHE_DIR",
        "the root of every portakern cache (tuning database, CUDA modules, PyOpenCL's "
        "compiled programs under <cache dir>/pyopencl); unset: $XDG_CACHE_HOME/portakern "
        "or ~/.cache/portakern, and PyOpenCL keeps its own default")
    cuda = PathOrOff(
        "PORTAKERN_CUDA_CACHE",
        "compiled CUDA modules on disk, and CuPy's own cache (CUPY_CACHE_DIR) when that is "
        "unset: a directory, or off; unset: <cache dir>/cuda")
    opencl = FilePath(
        "PORTAKERN_OPENCL_CACHE",
        "PyOpenCL's compiled-program cache; unset: <cache dir>/pyopencl when "
        "PORTAKERN_CACHE_DIR is set or there is no home directory, else PyOpenCL's "
        "default (~/.cache/pyopencl)")


class Tuning(Group):
    """Tuned kernel configurations."""

    __slots__ = ()
    topic = "tuning"
    mode = Choice(
        "PORTAKERN_TUNING", "nearest", ("nearest", "exact", "off"),
        "tuned-config lookups: nearest (the nearest tuned problem bucket), exact (only the "
        "same bucket) or off")


class Kernels(Group):
    """C-kernel backends' (OpenCL, CUDA) compiled code."""

    __slots__ = ()
    topic = "kernels"
    cache_size = Count(
        "PORTAKERN_KERNEL_CACHE_SIZE", 128,
        "compiled programs kept per C-kernel backend (least recently used evicted)")


class Jax(Group):
    """The jax backend's compiled code."""

    __slots__ = ()
    topic = "jax"
    function_cache_size = Count(
        "PORTAKERN_FUNCTION_CACHE_SIZE", 64, "jitted functions kept per jax backend")
    executable_cache_size = Count(
        "PORTAKERN_EXECUTABLE_CACHE_SIZE", 64,
        "XLA executables kept in all by a jax backend's jitted functions")


class Host(Group):
    """Host memory."""

    __slots__ = ()
    topic = "host"
    memory_budget = Text(
        "PORTAKERN_HOST_MEMORY_BUDGET",
        "the most host memory one call may ask for, e.g. 8G or 512M; unset: half of "
        "physical memory, less if /proc/meminfo or ulimit -v says so")


class OpenCL(Group):
    """The OpenCL backend."""

    __slots__ = ()
    topic = "opencl"
    pool = Switch(
        "PORTAKERN_OPENCL_POOL",
        "allocate OpenCL arrays from a memory pool (off: one clCreateBuffer each)")
    hugepages = Switch(
        "PORTAKERN_OPENCL_HUGEPAGES",
        "ask Linux for transparent huge pages under large buffers of a CPU OpenCL device "
        "(madvise; off: the OS's default pages)")
    icds = Text(
        "PORTAKERN_OPENCL_ICDS",
        "OpenCL ICD libraries loaded directly, beside those the ICD loader lists (paths "
        "separated by ':'; off: none); unset: Intel's CPU runtime when pip installed it in "
        "this environment's lib/ (portakern[intel])")


class Oclgrind(Group):
    """The Oclgrind simulator (opencl:oclgrind)."""

    __slots__ = ()
    topic = "oclgrind"
    enabled = Switch(
        "PORTAKERN_OCLGRIND",
        "offer the Oclgrind simulator as opencl:oclgrind when it is installed")
    icd = FilePath(
        "PORTAKERN_OCLGRIND_ICD",
        "Oclgrind's ICD library (liboclgrind-rt-icd.so); unset: found beside oclgrind")


class Tools(Group):
    """External programs the tools run, and how many at once."""

    __slots__ = ()
    topic = "tools"
    compile_jobs = OptionalCount(
        "PORTAKERN_COMPILE_JOBS",
        "worker processes of `portakern check --compile-only`; unset: the CPUs, at most 8")
    ptxas = FilePath(
        "PORTAKERN_PTXAS",
        "the ptxas the resource report runs; unset: the portakern[cuda] wheel's "
        "(nvidia-cuda-nvcc-cu12), then PATH, beside nvcc, $CUDA_PATH/bin, /usr/local/cuda/bin")
    hipcc = FilePath(
        "PORTAKERN_HIPCC",
        "the hipcc the AMD compile check runs; unset: PATH, then /opt/rocm/bin/hipcc")


class Mma(Group):
    """Matrix units (docs/fragments.md)."""

    __slots__ = ()
    topic = "mma"
    layout = StrictChoice(
        "PORTAKERN_MMA_LAYOUT", "sm80", ("sm80", "cdna", "rdna3", "intel"),
        "the lane map the fragment API's emulation mirrors on devices without matrix units "
        "(PoCL, Intel's CPU runtime, Oclgrind): sm80 (NVIDIA mma.sync), cdna (AMD MFMA), "
        "rdna3 (AMD WMMA) or intel (Intel's sub-group matrix multiply); a kernel that "
        "assumes one layout fails under the others. Devices with matrix units always use "
        "their own")


selection = Selection()
cache = Cache()
tuning = Tuning()
kernels = Kernels()
jax = Jax()
host = Host()
opencl = OpenCL()
oclgrind = Oclgrind()
tools = Tools()
mma = Mma()

GROUPS: tuple[Group, ...] = (selection, cache, tuning, kernels, jax, host, opencl, oclgrind,
                             tools, mma)
SETTINGS: dict[str, Knob[Any]] = {k.env: k for g in GROUPS for k in g.knobs()}


# --- the low-level reader, by variable name -----------------------------------------------
def _knob(name: str) -> Knob[Any]:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared setting (portakern/core/settings.py)"
                       ) from None


def raw(name: str) -> str | None:
    """The variable's text, stripped; None when unset or blank. Low-level: read
    ``settings.<topic>.<knob>`` instead, or its knob's ``text()``."""
    return _knob(name).text()


def get(name: str) -> Any:
    """The typed value of the variable ``name``: the one internal low-level reader, for the
    modules not yet migrated to the typed attributes (``settings.<topic>.<knob>``, which
    new code reads). The default when unset, blank or malformed; see each knob's kind."""
    return _knob(name).value()


class Described(NamedTuple):
    name: str  # the variable
    path: str  # settings.<path>
    shown: str  # 'value (set)' or 'default: value'
    doc: str


def describe() -> list[Described]:
    """Every setting with its value or default, for `portakern info`."""
    out = []
    for knob in SETTINGS.values():
        text = knob.text()
        shown = f"{text} (set)" if text is not None else \
            f"default: {'unset' if knob.default is None else knob.default}"
        out.append(Described(knob.env, knob.path, shown, knob.doc))
    return out


# --- the dispatch path's watcher ----------------------------------------------------------
# ``os.environ.get`` costs ~0.3 µs for a set variable and ~0.6 µs for an unset one (it encodes
# the name, and an unset name raises and catches KeyError), too much for every call. The
# watcher keeps the value and re-reads it only after a change: every ``os.environ[...] = ...``,
# ``del os.environ[...]`` and ``monkeypatch.setenv`` calls ``os.putenv``/``os.unsetenv``, which
# raise the documented audit events of the same names (PEP 578), and one audit hook, added on
# the first ``watcher()`` call, marks the watched variable changed. Audit hooks cannot be
# removed: the hook costs ~0.15 µs on each audited event of the process (open, import, ...).
# Where there are no audit hooks (or a hook refuses ours) the watcher is os.environ.get.
_ENV_EVENTS = frozenset({"os.putenv", "os.unsetenv"})
_PROBE = "portakern_watch_probe"  # never set: unset once to see that the events arrive
_UNKNOWN = object()


class _Watch:
    """One watched variable: ``value`` is valid while not ``dirty``; a change announces the
    text it sets (``expect``) and bumps ``gen``."""

    __slots__ = ("env", "value", "expect", "gen", "dirty")

    def __init__(self, env: str) -> None:
        self.env = env
        self.value: str | None = None
        self.expect: object = os.environ.get(env)
        self.gen = 0
        self.dirty = True


_WATCHES: dict[str, _Watch] = {}
_WATCH_LOCK = threading.RLock()
_hook_state = {"installed": False, "works": False, "probe_seen": False}


def _decode(value: object) -> str:
    return os.fsdecode(value) if isinstance(value, bytes) else str(value)


def _env_event(event: str, args: tuple[Any, ...]) -> None:
    """A variable is about to change (the hook runs before os.environ's own dict is updated)."""
    try:
        key = _decode(args[0])
        if key == _PROBE:
            _hook_state["probe_seen"] = True
            return
        if os.name == "nt":
            key = key.upper()
        watch = _WATCHES.get(key)
        if watch is None:
            return
        changed: list[tuple[_Watch, object]] = [
            (watch, None if event == "os.unsetenv" else _decode(args[1]))]
    except Exception:  # never break the caller's putenv: treat every watch as changed
        changed = [(w, _UNKNOWN) for w in list(_WATCHES.values())]
    with _WATCH_LOCK:
        for watch, expect in changed:
            watch.expect = expect
            watch.gen += 1
            watch.dirty = True


def _audit(event: str, args: tuple[Any, ...], _events: frozenset[str] = _ENV_EVENTS) -> None:
    if event in _events:
        _env_event(event, args)


def _refresh(watch: _Watch) -> str | None:
    """The slow path after a change: read os.environ; keep the value once it is the one the
    change announced (until then, or when os.putenv was called around os.environ, the next
    call reads again)."""
    with _WATCH_LOCK:
        gen = watch.gen
        value = os.environ.get(watch.env)
        if value == watch.expect:
            watch.value = value
            watch.dirty = False
            if watch.gen != gen:  # a change re-entered meanwhile (a signal handler)
                watch.dirty = True
        return value


def _hooked() -> bool:
    """Add the audit hook once; whether the environment's events reach it."""
    with _WATCH_LOCK:
        if not _hook_state["installed"]:
            _hook_state["installed"] = True
            try:
                sys.addaudithook(_audit)
                os.unsetenv(_PROBE)
            except Exception:  # no audit hooks here, or one refused ours
                pass
            _hook_state["works"] = _hook_state["probe_seen"]
        return _hook_state["works"]


def _after_fork_in_child() -> None:
    global _WATCH_LOCK
    _WATCH_LOCK = threading.RLock()  # a thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def watcher(name: str) -> Callable[[], str | None]:
    """A zero-argument callable giving the variable's current text (unstripped; None when
    unset), for the per-call dispatch path, whose key must change when the variable does:
    ~30 ns per call once read (a slot read), re-read from os.environ after each change made
    through ``os.environ`` (not after a C-level ``putenv``, which os.environ does not see
    either)."""
    _knob(name)
    if not _hooked():
        return functools.partial(os.environ.get, name)
    with _WATCH_LOCK:
        watch = _WATCHES.get(name)
        if watch is None:
            watch = _WATCHES[name] = _Watch(name)

    def current() -> str | None:
        if watch.dirty:
            return _refresh(watch)
        return watch.value

    return current

"""Tuned-config lookup: the read-only side of the autotuner (runtime layer).

What a backend consults when its config cache misses: the per-device database of tuned
configurations that ``portakern tune`` (tools/autotune.py) writes. Buckets, device keys,
entry parsing and validation live here; the search itself does not, so a call never loads it.

``GENERATION`` is the public tuning generation: saving or clearing entries in this process
(``invalidate``) bumps it, and caches keyed on it (``cache_token``) re-run ``lookup``. Read it
as ``tuned.GENERATION`` (a module attribute, not a copy).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import codegen, dtypes, settings
from ..core.cache import CacheWarning, Store
from ..core.errors import InvalidArgumentError, PortakernError
from ..core.lru import LRUCache
from ..core.spec import KernelSpec, Problem

if TYPE_CHECKING:
    from ..backend.base import Backend, DeviceInfo

ENV_TUNING = "PORTAKERN_TUNING"
NAMESPACE = "tuning"
SCHEMA = 1

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_HASH_RE = re.compile(r"^[0-9a-f]{16}$")
_BUCKET_RE = re.compile(r"^[a-z0-9]{1,16}(\.[A-Za-z_][A-Za-z0-9_]{0,31}[0-9]{1,2})*$")
_DEVKEY_RE = re.compile(r"^[a-z0-9_]{1,32}-[0-9a-f]{16}$")



class TuningWarning(CacheWarning):
    """A tuned entry was ignored (invalid, or rejected by the spec); the default is used."""


# --- switches and buckets -----------------------------------------------------------------
def mode() -> str:
    """'off', 'exact' or 'nearest' from $PORTAKERN_TUNING (default 'nearest')."""
    return settings.tuning.mode


def size_class(v: int) -> int:
    """ceil(log4 v) for v >= 1 (0 for v <= 1): class k holds sizes in (4^(k-1), 4^k]."""
    return ((max(int(v), 1) - 1).bit_length() + 1) // 2


Bucket = tuple[str, tuple[tuple[str, int], ...]]


def bucket(prob: Problem) -> Bucket:
    """(dtype, sorted (name, size class) of the problem's integer sizes). Runs on every op call
    (it keys the backends' config cache), so it is written for speed: ~1 us."""
    out = []
    for k, v in prob.derived.items():
        t = type(v)
        if t is int or (t is not bool and isinstance(v, np.integer)):
            v = int(v)
            out.append((k, (((v if v > 1 else 1) - 1).bit_length() + 1) >> 1))
    out.sort()
    return (prob.dtype, tuple(out))


def bucket_key(b: Bucket) -> str:
    """The stored spelling of a bucket, e.g. 'float32.K4.M4.N4'."""
    return ".".join([b[0]] + [f"{k}{c}" for k, c in b[1]])


def bucket_label(b: Bucket) -> str:
    """The human spelling, e.g. 'float32 K<=256 M<=256 N<=256'."""
    return " ".join([b[0]] + [f"{k}<={4 ** c}" for k, c in b[1]])


GENERATION = 0
_LOCK = threading.RLock()


def cache_token(prob: Problem) -> tuple[int, Bucket]:
    """What a backend's per-spec config cache is keyed on (see the module docstring)."""
    return (GENERATION, bucket(prob))


def invalidate() -> None:
    """Forget entries read from disk and make every backend re-run ``lookup``."""
    global GENERATION
    with _LOCK:
        _INDEX.clear()
        _WARNED_ENTRIES.clear()
        GENERATION += 1


# --- device fingerprints ------------------------------------------------------------------
def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host's CPU model and vector flags ('' where /proc/cpuinfo is unreadable): what a
    CPU device's tuning depends on and its reported name may not say (jax names every CPU
    'cpu'; one VM image runs on an AVX-512 Xeon one day and an AVX2 EPYC the next). An Arm
    Linux host has no 'model name' line: its core is named by implementer and part
    ('arm 0x41:0xd0c', a Neoverse N1) and its vector features come from 'Features'."""
    if cpuinfo in _HOST_CPU:
        return _HOST_CPU[cpuinfo]
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if value.strip():  # the first non-empty value of each field
                    fields.setdefault(key.strip(), " ".join(value.split()))
    except OSError:
        pass
    model = fields.get("model name", "")
    if not model and "CPU implementer" in fields and "CPU part" in fields:
        model = f"arm {fields['CPU implementer']}:{fields['CPU part']}"
    flags, features = set(fields.get("flags", "").split()), set(fields.get("Features", "").split())
    simd = ([f for f in _X86_SIMD if f in flags]  # (x86's 'sme' is AMD's memory encryption)
            + [f for f in _ARM_SIMD if f in features])
    _HOST_CPU[cpuinfo] = f"{model} [{' '.join(simd)}]" if model else ""
    return _HOST_CPU[cpuinfo]


# the vector features that change which CPU schedule wins: x86's 'flags', Arm's 'Features'
_X86_SIMD = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
_ARM_SIMD = ("asimd", "sve", "sve2", "sme", "bf16", "i8mm")


_HOST_CPU: dict[str, str] = {}


def fingerprint_of(backend_name: str, info: DeviceInfo, versions: Mapping[str, str]
                   ) -> dict[str, Any]:
    """What a tuning result is only valid for: the device, its driver, the runtime/compiler
    (the OpenCL platform too: PoCL and Intel's runtime on one CPU keep entries apart), and on
    a CPU device the host's CPU model and vector flags (``host_cpu``)."""
    fp = {"backend": str(backend_name), "vendor": str(info.vendor), "name": str(info.name),
          "implementation": str(info.extra.get("alias", "")),
          "driver": str(info.driver), "platform": str(info.platform),
          "versions": {str(k): str(v) for k, v in sorted(versions.items())}}
    if info.kind == "cpu":
        fp["host_cpu"] = host_cpu()
    return fp


def fingerprint(backend: Backend) -> dict[str, Any]:
    return fingerprint_of(backend.name, backend.device, type(backend).probe().versions)


def device_key(fp: Mapping[str, Any]) -> str:
    """A directory name for a fingerprint: readable backend name + hash of all of it."""
    h = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    readable = "_".join(str(fp[k]) for k in ("backend", "implementation") if fp.get(k))
    name = re.sub(r"[^a-z0-9_]", "_", readable.lower())[:32] or "x"
    return f"{name}-{h}"


def store_for(devkey: str) -> Store:
    return Store(f"{NAMESPACE}/{devkey}")


def entry_key(op: str, bkey: str, source_hash: str) -> str:
    return f"{op}.{bkey}.{source_hash}"


# --- entries ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """A schema-checked tuning record (its config values are checked later, by the spec)."""

    op: str
    source_hash: str
    bucket: Bucket
    config: dict[str, Any]
    device_key: str
    device: dict[str, Any]
    time_s: float | None = None
    default_time_s: float | None = None
    tuned_at: str = ""
    shapes: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return entry_key(self.op, bucket_key(self.bucket), self.source_hash)

    @property
    def speedup(self) -> float | None:
        if self.time_s and self.default_time_s:
            return self.default_time_s / self.time_s
        return None


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        return None
    return float(x)


def parse_entry(payload: object) -> Entry | str:
    """An Entry, or a sentence saying what is wrong with the stored record."""
    if not isinstance(payload, dict):
        return f"expected a JSON object, got {type(payload).__name__}"
    if payload.get("schema") != SCHEMA:
        return f"schema {payload.get('schema')!r}, expected {SCHEMA}"
    op, src, bkey = payload.get("op"), payload.get("source_hash"), payload.get("bucket")
    if not isinstance(op, str) or not _IDENT_RE.match(op):
        return f"op {op!r} is not an identifier"
    if not isinstance(src, str) or not _HASH_RE.match(src):
        return f"source_hash {src!r} is not 16 hex digits"
    dtype, classes = payload.get("dtype"), payload.get("classes")
    if not isinstance(dtype, str) or dtype not in dtypes.FLOAT_DTYPES:
        return f"dtype {dtype!r} is not one of {sorted(dtypes.FLOAT_DTYPES)}"
    if not isinstance(classes, dict) or not all(
            isinstance(k, str) and _IDENT_RE.match(k) and isinstance(v, int)
            and not isinstance(v, bool) and 0 <= v <= 32 for k, v in classes.items()):
        return "classes must map size names to integers 0..32"
    b: Bucket = (dtype, tuple(sorted(classes.items())))
    if not isinstance(bkey, str) or not _BUCKET_RE.match(bkey) or bkey != bucket_key(b):
        return f"bucket {bkey!r} does not match dtype and classes ({bucket_key(b)!r})"
    config = payload.get("config")
    if not isinstance(config, dict) or not config or not all(
            isinstance(k, str) and _IDENT_RE.match(k) for k in config):
        return "config must map tunable names to values"
    devkey, device = payload.get("device_key"), payload.get("device")
    if not isinstance(devkey, str) or not _DEVKEY_RE.match(devkey) or not isinstance(device, dict):
        return "device_key/device missing or malformed"
    shapes = payload.get("shapes")
    return Entry(op=op, source_hash=src, bucket=b, config=dict(config), device_key=devkey,
                 device=dict(device), time_s=_number(payload.get("time_s")),
                 default_time_s=_number(payload.get("default_time_s")),
                 tuned_at=str(payload.get("tuned_at", ""))[:40],
                 shapes=shapes if isinstance(shapes, dict) else {})


def device_entries(devkey: str) -> Iterator[Entry | tuple[str, str]]:
    """Every record of one device: an Entry, or (file key, why it is unusable)."""
    for key, payload in store_for(devkey).items():
        got = parse_entry(payload)
        if isinstance(got, str):
            yield key, got
        elif got.device_key != devkey or got.key != key:
            yield key, "it is filed under another device or key than it names"
        else:
            yield got


# --- lookup -------------------------------------------------------------------------------
_INDEX: dict[tuple[str, str], dict[tuple[str, str], list[Entry]]] = {}
_WARNED_ENTRIES: set[tuple[str, str, str]] = set()  # warn once per process


def _warn_entry(devkey: str, key: str, why: str) -> None:
    with _LOCK:
        if (devkey, key, why) in _WARNED_ENTRIES:
            return
        _WARNED_ENTRIES.add((devkey, key, why))
    warnings.warn(f"portakern tuning: ignored entry {key!r} of device {devkey}: {why}; the "
                  f"default schedule is used. Fix: re-run `portakern tune`, or clear the "
                  f"database with `portakern tune --clear`.", TuningWarning, stacklevel=4)


def _index(devkey: str) -> dict[tuple[str, str], list[Entry]]:
    """The device's usable entries by (op, source hash): read from disk once per process."""
    root = str(store_for(devkey).root)
    with _LOCK:
        got = _INDEX.get((root, devkey))
        if got is None:
            got = {}
            for e in device_entries(devkey):
                if isinstance(e, Entry):
                    got.setdefault((e.op, e.source_hash), []).append(e)
                else:
                    _warn_entry(devkey, e[0], e[1])
            _INDEX[(root, devkey)] = got
        return got


def _distance(a: Bucket, b: Bucket) -> int | None:
    if a[0] != b[0] or [k for k, _ in a[1]] != [k for k, _ in b[1]]:
        return None
    return sum(abs(x - y) for (_, x), (_, y) in zip(a[1], b[1], strict=True))


def lookup(backend: Any, spec: KernelSpec, prob: Problem) -> dict[str, int] | None:
    """The validated tuned configuration for this device, kernel and problem, or None.

    Exact bucket first, then (unless PORTAKERN_TUNING=exact) the nearest tuned bucket of the
    same dtype. Entries for another kernel source are stale and never considered; an entry the
    spec rejects warns and is skipped."""
    if not spec.tunables:
        return None
    how = mode()
    if how == "off":
        return None
    devkey = device_key(fingerprint(backend))
    entries = _index(devkey).get((spec.name, codegen.source_hash(spec.source)))
    if not entries:
        return None
    want = bucket(prob)
    ranked = sorted(((d, bucket_key(e.bucket), e) for e in entries
                     if (d := _distance(want, e.bucket)) is not None), key=lambda t: t[:2])
    known = {t.name: t for t in spec.tunables}
    for d, _, e in ranked:
        if d and how == "exact":
            break
        try:  # the entry itself: only declared tunables, every value inside its domain
            bad = sorted(set(e.config) - set(known))
            if bad:
                raise InvalidArgumentError(f"{spec.name}: unknown tunables {bad}; this op "
                                           f"declares {sorted(known)}")
            for k, v in e.config.items():
                known[k].check(v, spec.name)
        except PortakernError as exc:
            _warn_entry(devkey, e.key, f"the spec rejects it ({exc})")
            continue
        try:  # and for this problem: the spec's own check and the launch geometry
            cfg = spec.config(backend.schedule_class, e.config, prob,
                              matrix=has_matrix_unit(backend))
            wg = max((la.local[0] * la.local[1] * la.local[2] for la in spec.launches(prob, cfg)),
                     default=1)
        except PortakernError as exc:
            if d == 0:
                _warn_entry(devkey, e.key, f"the spec rejects it for this problem ({exc})")
            continue
        if wg > backend.device.max_work_group_size:
            continue
        return cfg
    return None


def fitted(backend: Backend, spec: KernelSpec, prob: Problem, cfg: dict[str, int]
            ) -> dict[str, int]:
    """``cfg`` with the spec's automatic tunables resolved for this device (fit_device)."""
    if spec.fit_device is None:
        return cfg
    return spec.fit_device(prob, dict(cfg), max(1, int(backend.device.compute_units)))


def has_matrix_unit(backend: Backend) -> bool:
    """Whether the device has matrix units a spec's "mma" schedule uses (docs/fragments.md)."""
    return getattr(backend, "matrix_unit", None) is not None


# --- listing ------------------------------------------------------------------------------
_CONFIGS: LRUCache = LRUCache(4096)  # (backend, spec token, generation, bucket) -> config


def config_for(backend: Backend, spec: KernelSpec, prob: Problem,
               overrides: Mapping[str, int] | None = None) -> dict[str, int]:
    """The kernel configuration a C-kernel call runs with, chosen above the backends (the
    Plan layer calls this when it compiles a plan; the benchmark, the tracer and the tests
    ask the same question here): the caller's ``overrides`` (checked against the tunables'
    domains), else this device's tuned entry for the problem's bucket (``lookup``; never for
    a backend whose ``uses_tuned_configs`` is False, e.g. the simulator), else the spec's
    schedule for the device's schedule class ('cpu256' on AVX2, KernelSpec.schedule_for).
    Tuned lookups are memoised per (backend, spec, tuning generation, bucket) in one bounded
    cache; the automatic tunables are fitted after it, per problem, since a bucket spans
    sizes they tell apart (N = 512 and 1024 share one)."""
    if overrides:
        return fitted(backend, spec, prob, spec.config(backend.schedule_class, overrides, prob,
                                                        matrix=has_matrix_unit(backend)))
    key = (backend, spec.token) + cache_token(prob)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        found = lookup(backend, spec, prob) if backend.uses_tuned_configs else None
        cfg = found or spec.config(backend.schedule_class, None, prob,
                                   matrix=has_matrix_unit(backend))
        with _LOCK:
            _CONFIGS[key] = cfg
    return fitted(backend, spec, prob, dict(cfg))


def _current_hash(op: str) -> str | None:
    from ..ops import OPS

    spec = OPS.get(op)
    return codegen.source_hash(spec.source) if spec is not None else None


def summarize(e: Entry) -> dict[str, Any]:
    from ..ops import OPS

    cur = _current_hash(e.op)
    order = [t.name for t in OPS[e.op].tunables] if e.op in OPS else []
    cfg = {k: e.config[k] for k in order if k in e.config}
    cfg.update({k: v for k, v in sorted(e.config.items()) if k not in cfg})
    return {"op": e.op, "bucket": bucket_key(e.bucket), "label": bucket_label(e.bucket),
            "config": cfg, "time_s": e.time_s, "default_time_s": e.default_time_s,
            "speedup": e.speedup, "tuned_at": e.tuned_at, "source_hash": e.source_hash,
            "stale": cur != e.source_hash}


def format_entry(s: Mapping[str, Any]) -> str:
    cfg = " ".join(f"{k}={v}" for k, v in s["config"].items())
    sp = f"{s['speedup']:.2f}x vs default" if s.get("speedup") else "speedup unknown"
    stale = "  [STALE: kernel changed since; ignored — re-run portakern tune]" if s["stale"] else ""
    return f"{s['op']} {s['label']}: {cfg} ({sp}, {s['tuned_at'] or 'date unknown'}){stale}"


def tuned_summary(backend_name: str, info: DeviceInfo, versions: Mapping[str, str]
                  ) -> list[dict[str, Any]]:
    """What is tuned for one device (for `portakern info`); unusable records are left out."""
    devkey = device_key(fingerprint_of(backend_name, info, versions))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        out = [summarize(e) for e in device_entries(devkey) if isinstance(e, Entry)]
    return sorted(out, key=lambda s: (s["op"], s["bucket"]))

"""Benchmark cases and suites: which ops, sizes and dtypes, and how long each may take.

``quick`` is sized for a 2-core CPU running PoCL (it must finish in under 5 minutes there):
each op at three or four sizes, fp32, with the large attention case (~34 GFLOP) measured
only a few times under the time box. ``full`` sweeps sizes and dtypes for GPUs; on a CPU it
takes long and its biggest cases are cut by the same time box rather than skipped.

Every registered op is benchmarked, the user's own included, without editing this file: the
built-in ops have hand-picked sizes in ``SIZES``; any other op gets its cases from its spec
(``spec_tools.example_inputs``: the spec's example in ``quick``, plus the example scaled up to
about 2^24 and 2^26 elements in ``full``). Why from the spec: the op's author knows what a
typical call looks like; the bench does not.

Inputs are generated from the case alone (op, dtype, size, seed) and the spec's operand list
(names, kinds), so the numpy peer, which runs in its own process, rebuilds exactly the arrays
every other implementation gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ...core import dtypes
from ...core.errors import DTypeError, InvalidArgumentError, PortakernError
from ...core.spec import MAX_INDEX, KernelSpec
from .timing import TimingConfig

# ops whose size record has a format of its own (M/N/K, rows/cols, B/H/S/D) and hand-picked
# sizes below; every other op's size record is {operand: shape} taken from its spec
BUILTIN_SIZE_OPS = ("matmul", "softmax", "attention", "attention_backward")
# ops whose sizes are attention's B/H/S/D record
ATTENTION_OPS = ("attention", "attention_backward")
# ops whose sizes are a decode record (B, Hq, Hkv, D, ctx, BS, split): paged KV caches
PAGED_OPS = ("paged_attention",)
# the dtype a suite runs an op in when the command line names none (decode: an fp16 cache)
OP_DTYPES = {"paged_attention": ("float16",)}
# the unfused peers gather the cache and repeat it to every query head in the compute type:
# beyond this many bytes of that they are not run. 256 MiB keeps them to B1 at 4096 tokens
# in the quick suite (numpy takes ~0.6 s a call there on 2 cores, ~5 s at 1 GiB; B8 at
# 32768 tokens would need 8 GiB)
PAGED_PEER_BYTES = 256 << 20
# ``full`` adds the spec's example scaled to about this many elements in its largest operand
DERIVED_FULL_ELEMENTS = (1 << 24, 1 << 26)


def all_ops() -> tuple[str, ...]:
    """Every registered op, plugins included, in registration order (the default --ops).

    A function, not a constant: an op registered after this module was imported (a user's
    register_op, a test) must still be benchmarked.
    """
    from ...ops import OPS

    return tuple(OPS)


def operand_names(op: str) -> list[str]:
    """The op's operands in call order: how every implementation is handed its inputs."""
    from ...ops import get_op

    return [o.name for o in get_op(op).operands]


@dataclass(frozen=True)
class BenchCase:
    """One benchmark problem: op, dtype, a size record and the op's parameters."""

    op: str
    dtype: str
    size: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def label(self) -> str:
        return size_label(self.op, self.size, self.params)

    @property
    def id(self) -> str:
        return f"{self.op}/{self.dtype}/{self.label}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchCase:
        return cls(op=d["op"], dtype=d["dtype"], size=dict(d["size"]),
                   params=dict(d.get("params") or {}), seed=int(d.get("seed", 0)))


def size_label(op: str, size: dict[str, Any], params: dict[str, Any]) -> str:
    """A short, unique, human-readable name of a size (used as the case key in reports)."""
    if op in PAGED_OPS:
        return paged_label(size)
    if op not in BUILTIN_SIZE_OPS:
        return generic_label(op, size, params)
    if op == "matmul":
        M, N, K = size["M"], size["N"], size["K"]
        lab = f"N={N}" if M == N == K else f"M={M} N={N} K={K}"
        batch = size.get("batch") or []
        return (f"B={'x'.join(map(str, batch))} " + lab) if batch else lab
    if op == "softmax":
        return f"{size['rows']}x{size['cols']}"
    if op in ATTENTION_OPS:
        lab = f"B{size['B']} H{size['Hq']} S{size['Sq']}"
        if size["Sk"] != size["Sq"]:
            lab += f" Sk{size['Sk']}"
        lab += f" D{size['D']}"
        if size["Dv"] != size["D"]:
            lab += f" Dv{size['Dv']}"
        if size["Hkv"] != size["Hq"]:
            lab += f" kv{size['Hkv']}"
        if params.get("causal"):
            lab += " causal"
        return lab
    return ",".join(f"{k}={v}" for k, v in sorted(size.items()))


def paged_label(size: dict[str, Any]) -> str:
    """``B1 H32 kv8 D128 ctx32768 split auto`` / ``... unsplit`` / ``... split8``: a decode
    step over a paged cache of ``ctx`` tokens per sequence, the kernel's key splits as a
    user's call chooses them (0) or forced (1: none)."""
    n = int(size.get("split", 0))
    how = "unsplit" if n == 1 else f"split{n}" if n else "split auto"
    return (f"B{size['B']} H{size['Hq']} kv{size['Hkv']} D{size['D']} ctx{size['ctx']} "
            f"{how}")


def bench_config(case: BenchCase) -> dict[str, int] | None:
    """Tunables a case forces on portakern's kernel (decode rows: the number of splits)."""
    if case.op in PAGED_OPS and int(case.size.get("split", 0)):
        return {"SPLIT": int(case.size["split"])}
    return None


def peer_skip(case: BenchCase) -> str | None:
    """Why the peers do not run on a case (None: they do). Decode rows: the peers run beside
    the row users get (split auto: no config), and a row that forces a split count shares
    them (the peers do not split); the unfused peers' gathered, head-repeated cache must
    fit PAGED_PEER_BYTES."""
    if case.op not in PAGED_OPS:
        return None
    s = case.size
    if int(s.get("split", 0)) != 0:
        return ("the peers of this decode case are on its split-auto row (they do not "
                "split)")
    nbytes = 2 * s["B"] * s["Hq"] * s["ctx"] * s["D"] * dtypes.info(case.dtype).compute.itemsize
    if nbytes > PAGED_PEER_BYTES:
        return (f"the unfused peers would gather and repeat the cache to {s['Hq']} heads in "
                f"{dtypes.info(case.dtype).compute.name}: {nbytes / 2**20:.0f} MiB, more than "
                f"the {PAGED_PEER_BYTES >> 20} MiB this suite allows them (their time)")
    return None


def generic_label(op: str, size: dict[str, Any], params: dict[str, Any]) -> str:
    """``x=64x4096 weight=4096``: each present operand's shape, then the parameters that
    differ from the spec's defaults (two cases of one op differ in one of those)."""
    parts = []
    for name, shp in size.items():
        if shp is not None:
            parts.append(f"{name}={'x'.join(map(str, shp)) if len(shp) else 'scalar'}")
    try:
        from ...ops import get_op

        defaults = dict(get_op(op).params)
    except PortakernError:  # an op no longer registered (a result file read later)
        defaults = {}
    for k, v in sorted(params.items()):
        if k not in defaults or defaults[k] != v:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def shapes(case: BenchCase) -> dict[str, tuple[int, ...]]:
    """Shapes of a case's present operands, in the op's operand order."""
    s = case.size
    if case.op in PAGED_OPS:
        mb = s["ctx"] // s["BS"]
        pool = (s["B"] * mb, s["Hkv"], s["BS"], s["D"])
        return {"q": (s["B"], s["Hq"], 1, s["D"]), "k_cache": pool, "v_cache": pool,
                "block_table": (s["B"], mb), "seq_lens": (s["B"],)}
    if case.op not in BUILTIN_SIZE_OPS:
        return {n: tuple(int(d) for d in s[n]) for n in operand_names(case.op)
                if s.get(n) is not None}
    if case.op == "matmul":
        batch = tuple(s.get("batch") or ())
        return {"a": batch + (s["M"], s["K"]), "b": batch + (s["K"], s["N"])}
    if case.op == "softmax":
        return {"x": (s["rows"], s["cols"])}
    if case.op in ATTENTION_OPS:
        qkv: dict[str, tuple[int, ...]] = {
            "q": (s["B"], s["Hq"], s["Sq"], s["D"]), "k": (s["B"], s["Hkv"], s["Sk"], s["D"]),
            "v": (s["B"], s["Hkv"], s["Sk"], s["Dv"])}
        if case.op == "attention":
            return qkv
        rows = (s["B"], s["Hq"], s["Sq"])
        return {"do": rows + (s["Dv"],), **qkv, "o": rows + (s["Dv"],), "lse": rows}
    raise InvalidArgumentError(f"bench: no input recipe for op {case.op!r}.")  # unreachable


def make_inputs(case: BenchCase) -> dict[str, np.ndarray | None]:
    """Deterministic host inputs of a case, one per operand of the spec in its order: float
    operands standard normal rounded to the storage dtype, bool operands random masks (half
    True), absent optional operands None."""
    from ...ops import get_op

    rng = np.random.default_rng(case.seed)
    st = dtypes.info(case.dtype).storage
    shp = shapes(case)
    out: dict[str, np.ndarray | None] = {}
    backward = case.op == "attention_backward"
    for o in get_op(case.op).operands:
        s = shp.get(o.name)
        if s is None or (backward and o.name in ("o", "lse")):
            out[o.name] = None
        elif o.kind == "bool":
            out[o.name] = rng.random(s) < 0.5
        elif o.kind == "acc":  # e.g. a log-sum-exp: in the compute type
            out[o.name] = rng.standard_normal(s).astype(dtypes.info(case.dtype).compute)
        elif o.kind == "int32":
            out[o.name] = paged_table(rng, o.name, s, case)
        elif case.op in PAGED_OPS and o.name.endswith("_cache"):
            out[o.name] = big_normal(rng, s, st)
        else:
            x = rng.standard_normal(s, dtype=np.float32)
            out[o.name] = x if st == np.float32 else x.astype(st)
    if backward:  # the forward's output and log-sum-exp, as pk.attention(return_lse=True)
        q, k, v = out["q"], out["k"], out["v"]
        assert q is not None and k is not None and v is not None
        out["o"], out["lse"] = host_forward(q, k, v, case.dtype, case.params.get("scale"))
    return out


def paged_table(rng: np.random.Generator, name: str, shape: tuple[int, ...],
                case: BenchCase) -> np.ndarray:
    """A decode case's int tables: every sequence full (seq_lens = ctx), its pages a random
    permutation of the pool (a fragmented cache: no two consecutive pages adjacent)."""
    if case.op not in PAGED_OPS:
        return np.zeros(shape, np.int32)
    if name == "seq_lens":
        return np.full(shape, case.size["ctx"], np.int32)
    return rng.permutation(int(np.prod(shape))).reshape(shape).astype(np.int32)


def big_normal(rng: np.random.Generator, shape: tuple[int, ...], storage: Any) -> np.ndarray:
    """A large operand from 2^20 standard normal values repeated (a cache of 10^8 values is
    filled in a fraction of a second; its values do not change a timing)."""
    n = int(np.prod(shape))
    m = min(n, 1 << 20)
    base = rng.standard_normal(m, dtype=np.float32).astype(storage)
    out = np.empty(n, storage)
    whole = n // m * m
    out[:whole].reshape(-1, m)[:] = base  # one broadcast copy
    out[whole:] = base[:n - whole]
    return out.reshape(shape)


def host_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype: str,
                 scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(o, lse) of non-causal, unmasked attention, computed on the host in the compute type
    (float32; float64 for float64) one (batch, head) at a time, so an S=4096 case never needs
    a float64 Sq x Sk array (one Sq x Sk compute-type block at a time): o = softmax(scale q
    k^T) v in the storage dtype, lse = logsumexp(scale q k^T) in the compute type. GQA:
    query head h reads kv head h // (Hq / Hkv)."""
    info = dtypes.info(dtype)
    ct = info.compute
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    if scale is None:
        scale = 1.0 / float(np.sqrt(D)) if D else 1.0
    o = np.empty(q.shape[:3] + (v.shape[-1],), ct)
    lse = np.empty(q.shape[:3], ct)
    for b in range(B):
        for h in range(Hq):
            s = np.matmul(q[b, h].astype(ct) * ct.type(scale), k[b, h // g].astype(ct).T)
            m = s.max(axis=-1, keepdims=True)
            s -= m
            np.exp(s, out=s)
            den = s.sum(axis=-1, keepdims=True)
            o[b, h] = np.matmul(s, v[b, h // g].astype(ct)) / den
            lse[b, h] = (m + np.log(den))[:, 0]
    return (o if info.storage == ct else o.astype(info.storage)), lse


# --- sizes of ops that the table below does not know: from the spec ----------------------
def _example_shapes(spec: KernelSpec) -> tuple[dict[str, tuple[int, ...] | None],
                                               dict[str, Any]]:
    """Operand shapes and parameters of the spec's example (the first dtype it accepts)."""
    from ...core.spec_checks import example_inputs

    last: Exception | None = None
    for dt in ("float32",) + tuple(d for d in dtypes.FLOAT_DTYPES if d != "float32"):
        try:
            got = example_inputs(spec, dt)
        except DTypeError as exc:
            last = exc
            continue
        if got is None:
            break
        arrays, params = got
        return ({o.name: (None if arrays.get(o.name) is None else
                          tuple(int(d) for d in arrays[o.name].shape))
                 for o in spec.operands}, dict(params))
    raise InvalidArgumentError(
        f"bench: op {spec.name!r} has no sizes: it is not in the built-in size table and its "
        "spec gives neither `example` nor `shapes`"
        + (f" ({type(last).__name__}: {last})" if last else "")
        + ". Fix: give the KernelSpec an example(dtype) or a shapes= family.")


def _size_names(spec: KernelSpec, base: Mapping[str, tuple[int, ...] | None]
                ) -> dict[str, tuple[str | int, ...]]:
    """Each operand's dims as size names: the spec's ``shapes`` family, else the example's
    dims tied by value (equal sizes are one name, size 1 stays a fixed 1)."""
    from ...core.spec_checks import shape_family

    family = shape_family(spec)
    if family is not None:
        return {n: family[n] for n, s in base.items() if s is not None and n in family}
    return {n: tuple(1 if d == 1 else f"d{d}" for d in s) for n, s in base.items()
            if s is not None}


def _numel(shp: tuple[int, ...]) -> int:
    n = 1
    for d in shp:
        n *= int(d)
    return n


def _scaled(spec: KernelSpec, base: Mapping[str, tuple[int, ...] | None], target: int
            ) -> dict[str, tuple[int, ...] | None] | None:
    """The example with one size name doubled until the largest operand has >= ``target``
    elements: the outermost non-last dim of the largest operand (rows, batch), else its last
    dim. None when the example is already that large or no size name can grow."""
    names = _size_names(spec, base)
    if not names:
        return None
    big = max(names, key=lambda n: _numel(base[n] or ()))
    if _numel(base[big] or ()) >= target:
        return None
    last = {dims[-1] for dims in names.values() if dims and isinstance(dims[-1], str)}
    dims = names[big]
    pick = next((d for d in dims if isinstance(d, str) and d not in last), None)
    pick = pick or next((d for d in reversed(dims) if isinstance(d, str)), None)
    if pick is None:
        return None
    value = {d: s for n in names for d, s in zip(names[n], base[n] or (), strict=True)
             if isinstance(d, str)}

    def with_value(v: int) -> dict[str, tuple[int, ...] | None]:
        out: dict[str, tuple[int, ...] | None] = dict(base)
        for n, ds in names.items():
            out[n] = tuple(v if d == pick else (d if isinstance(d, int) else value[d])
                           for d in ds)
        return out

    v = value[pick]
    while _numel(with_value(v)[big] or ()) < target:
        if _numel(with_value(2 * v)[big] or ()) > MAX_INDEX:
            return None
        v *= 2
    return with_value(v)


def derived_sizes(op: str, suite: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(size, params) of an op without a built-in size table: the spec's example (quick), and
    in ``full`` also the example scaled up (e.g. rmsnorm 64x4096 -> 4096x4096, 16384x4096).

    A scaled size the op's validate refuses (beyond its limits) is not a case of the op; the
    example itself always is (the spec's checks at registration accepted it).
    """
    from ...ops import get_op

    spec = get_op(op)
    base, params = _example_shapes(spec)
    shape_sets = [base]
    if suite == "full":
        for target in DERIVED_FULL_ELEMENTS:
            got = _scaled(spec, base, target)
            if got is None or got in shape_sets:
                continue
            try:  # shapes only: no arrays are allocated
                _validate_shapes(spec, got, params)
            except PortakernError:
                continue
            shape_sets.append(got)
    return [({n: list(s) for n, s in shp.items() if s is not None}, dict(params))
            for shp in shape_sets]


class _Meta:
    """Shape/dtype stand-in so a spec can validate a case without allocating it."""

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype = shape, dtype


def _validate_shapes(spec: KernelSpec, shp: Mapping[str, tuple[int, ...] | None],
                     params: Mapping[str, Any], dtype: str = "float32") -> None:
    st = dtypes.info(dtype).storage
    kinds = {o.name: o.kind for o in spec.operands}
    args = {n: _Meta(s, bool if kinds[n] == "bool" else st) for n, s in shp.items()
            if s is not None}
    spec.problem(*spec.bind((), {**args, **params}))


def metadata_inputs(case: BenchCase) -> list[Any]:
    """The case's operands as shape/dtype stand-ins (None for absent ones), in operand order:
    enough for validation and the cost model, nothing allocated."""
    from ...ops import get_op

    st = dtypes.info(case.dtype).storage
    shp = shapes(case)
    acc = dtypes.info(case.dtype).compute
    return [None if shp.get(o.name) is None else
            _Meta(shp[o.name], bool if o.kind == "bool" else acc if o.kind == "acc" else
                  np.int32 if o.kind == "int32" else st)
            for o in get_op(case.op).operands]


def _mm(n: int, m: int | None = None, k: int | None = None, batch: tuple[int, ...] = ()
        ) -> dict[str, Any]:
    return {"M": m or n, "N": n, "K": k or n, "batch": list(batch)}


def _att(s: int, d: int = 64, b: int = 1, h: int = 8, hkv: int | None = None,
         sk: int | None = None) -> dict[str, Any]:
    return {"B": b, "Hq": h, "Hkv": hkv or h, "Sq": s, "Sk": sk or s, "D": d, "Dv": d}


def _paged(b: int, ctx: int, split: int, h: int = 32, hkv: int = 8, d: int = 128,
           bs: int = 16) -> dict[str, Any]:
    return {"B": b, "Hq": h, "Hkv": hkv, "D": d, "ctx": ctx, "BS": bs, "split": split}


# (size, params) per op and suite, smallest first (``--limit N`` keeps the first N).
SIZES: dict[str, dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]] = {
    "quick": {
        # N=2048 and the causal S=4096 case carry README targets (issue 18, point 5)
        "matmul": [(_mm(256), {}), (_mm(512), {}), (_mm(1024), {}), (_mm(2048), {})],
        "softmax": [({"rows": 1024, "cols": 1024}, {}), ({"rows": 4096, "cols": 4096}, {}),
                    ({"rows": 8192, "cols": 4096}, {})],
        "attention": [(_att(512), {"causal": False}), (_att(1024), {"causal": False}),
                      (_att(1024, hkv=2), {"causal": False}), (_att(4096), {"causal": False}),
                      (_att(4096), {"causal": True})],
        # the S=4096 backward carries issue 28's target (<= 1.0x the unfused chain's time)
        "attention_backward": [(_att(1024), {"causal": False}), (_att(4096), {"causal": False})],
        # decode (issue 29): Llama-3-8B's heads, an fp16 cache; the splits a call chooses
        # (what users run) beside none forced
        "paged_attention": [(_paged(b, ctx, split), {}) for ctx in (4096, 32768)
                            for b in (1, 8) for split in (0, 1)],
    },
    "full": {
        "matmul": [(_mm(n), {}) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
        + [(_mm(4096, m=4096, k=256), {}), (_mm(64, m=8192, k=1024), {}),
           (_mm(512, batch=(16,)), {})],
        "softmax": [({"rows": r, "cols": c}, {}) for r, c in
                    ((1024, 1024), (4096, 4096), (8192, 4096), (65536, 128), (4096, 32768),
                     (16384, 16384))],
        "attention": [(_att(s), {"causal": False}) for s in (512, 1024, 2048, 4096, 8192, 16384)]
        + [(_att(4096, d=128), {"causal": False}), (_att(2048, d=128, h=32, hkv=8),
                                                    {"causal": False}),
           (_att(2048, b=4, h=16), {"causal": False}), (_att(4096), {"causal": True})],
        "attention_backward": [(_att(s), {"causal": False}) for s in (1024, 4096)],
        "paged_attention": [(_paged(b, ctx, split), {}) for ctx in (4096, 32768)
                            for b in (1, 8, 32) for split in (0, 1)],
    },
}

DEFAULT_DTYPES = {"quick": ("float32",), "full": ("float32", "float16", "bfloat16")}

TIMING = {
    "quick": TimingConfig(min_time=0.2, min_reps=3, max_reps=200, budget_s=30.0),
    "full": TimingConfig(min_time=0.5, min_reps=5, max_reps=1000, budget_s=60.0),
}


def op_sizes(op: str, suite: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(size, params) of an op in a suite, smallest first: the built-in table, else derived
    from the op's spec."""
    if op in SIZES[suite]:
        return list(SIZES[suite][op])
    return derived_sizes(op, suite)


def suite_cases(suite: str, ops: tuple[str, ...] | None = None,
                dtype_list: tuple[str, ...] | None = None, limit: int | None = None,
                skipped: dict[str, str] | None = None) -> list[BenchCase]:
    """The cases of a suite, op by op, dtype by dtype, smallest size first.

    An op asked for by name that has no sizes raises. With the default op list (every
    registered op), such an op is put into ``skipped`` (op -> why) when a dict is given, so
    one plugin without an example does not stop the benchmark of all the others, and the
    result file still names it.
    """
    if suite not in SIZES:
        raise InvalidArgumentError(f"unknown suite {suite!r}; expected one of {sorted(SIZES)}.")
    from ...ops import get_op

    explicit = bool(ops)
    ops = ops or all_ops()
    for op in ops:
        get_op(op)  # raises naming the registered ops
    dts = dtype_list or DEFAULT_DTYPES[suite]
    for dt in dts:
        dtypes.info(dt)  # raises DTypeError naming the supported set
    if limit is not None and limit < 1:
        raise InvalidArgumentError(f"--limit must be >= 1; got {limit}.")
    cases = []
    for op in ops:
        try:
            sizes = op_sizes(op, suite)
        except InvalidArgumentError as exc:
            if skipped is None or explicit:
                raise
            skipped[op] = str(exc)
            continue
        for dt in (dts if dtype_list or suite == "full" else OP_DTYPES.get(op, dts)):
            entries = sizes[:limit] if limit else sizes
            for size, params in entries:
                cases.append(BenchCase(op, dtypes.info(dt).name, dict(size), dict(params)))
    return cases

"""Test cases that break kernels and numerics, drawn from one source for pytest and `check`.

Shapes come from lists chosen to hit edges: 1, primes, tile sizes +- 1 (the default
schedules tile by 8, 16, 32 and 64), tall-skinny, odd head dims (40, 59, 80, 111), and long
reductions (matmul K = 4096 and 16384). Values include large offsets, NaN and +-inf entries,
all-positive and integer-valued matmul operands, fully masked rows and fp16's range. A ``Chooser``
abstracts where randomness comes from: hypothesis' ``data.draw`` in the test suite (so
failures shrink) or a seeded numpy Generator in ``portakern check``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import dtypes

EDGE_SIZES = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
HEAD_DIMS = (1, 8, 16, 40, 59, 64, 80, 111, 128)


class Chooser:
    """Draws primitive choices; subclasses wrap hypothesis or numpy."""

    def choice(self, options: Sequence[Any]) -> Any:
        raise NotImplementedError

    def boolean(self, p: float = 0.5) -> bool:
        raise NotImplementedError

    def seed(self) -> int:
        raise NotImplementedError


class NumpyChooser(Chooser):
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def choice(self, options: Sequence[Any]) -> Any:
        return options[int(self.rng.integers(len(options)))]

    def boolean(self, p: float = 0.5) -> bool:
        return bool(self.rng.random() < p)

    def seed(self) -> int:
        return int(self.rng.integers(2**31))


@dataclass
class Case:
    """One call: operand arrays (storage dtype), keyword params, and a readable description."""

    arrays: dict[str, np.ndarray | None]
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def describe(self) -> str:
        shapes = ", ".join(f"{k}{tuple(v.shape)}" for k, v in self.arrays.items() if v is not None)
        extra = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        note = f" [{self.note}]" if self.note else ""
        return f"{shapes}{'; ' + extra if extra else ''}{note}"


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0,
            offset: float = 0.0) -> np.ndarray:
    x = rng.standard_normal(shape) * scale + offset
    big = float(np.finfo(np.float16).max if dtype == "float16" else 1e300)
    return dtypes.cast_to(np.clip(x, -big, big), dtype)  # near the range, never past it


def _batch_pair(ch: Chooser) -> tuple[tuple[int, ...], tuple[int, ...]]:
    full = ch.choice(((), (1,), (3,), (2, 3), (2, 1, 3)))
    def variant() -> tuple[int, ...]:
        dims = list(full)
        if dims and ch.boolean(0.3):
            dims = dims[ch.choice(range(len(dims) + 1)):]  # drop leading dims
        return tuple(1 if ch.boolean(0.25) else d for d in dims)
    return variant(), variant()


LONG_K = (4096, 16384)  # reductions long enough to tell fp32 from TF32/bf16 inputs (verify)
MATMUL_VALUES = ("normal", "normal", "positive", "integer", "offset", "nonfinite")


def matmul_values(rng: np.random.Generator, kind: str, shape_a: tuple[int, ...],
                  shape_b: tuple[int, ...], dtype: str, scale: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Operands of one value family: normal; positive (uniform [0, 1), no cancellation);
    integer-valued (exact in every order while partial sums stay below 2^24); offset (a's
    entries around +-1e4, b's around +-1e4 or 0: a common offset the rounding must not
    bias); nonfinite (normal with a few NaN / +inf / -inf entries, which must land exactly
    where the oracle puts them). fp16 keeps its results below its range (65504)."""
    k = shape_a[-1]
    if kind == "positive":
        a, b = rng.random(shape_a) * scale, rng.random(shape_b)
    elif kind == "integer":
        hi = 2 if dtype == "float16" else 8
        a, b = (rng.integers(-hi, hi + 1, s).astype(np.float64) for s in (shape_a, shape_b))
    elif kind == "offset":
        off = 1e4 if dtype != "float16" else 64.0 / max(1.0, np.sqrt(k))
        sign_a = 1.0 if rng.random() < 0.5 else -1.0
        sign_b = float(rng.choice([1.0, -1.0, 0.0]))
        a = rng.standard_normal(shape_a) + sign_a * off
        b = rng.standard_normal(shape_b) + sign_b * off
    else:
        a, b = rng.standard_normal(shape_a) * scale, rng.standard_normal(shape_b)
    if kind == "nonfinite":
        for x in (a, b):
            if x.size and rng.random() < 0.7:
                flat = x.reshape(-1)
                for _ in range(int(rng.integers(1, 4))):
                    flat[int(rng.integers(flat.size))] = rng.choice([np.nan, np.inf, -np.inf])
    return _finite_cast(a, dtype), _finite_cast(b, dtype)


def _finite_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    big = float(np.finfo(np.float16).max if dtype == "float16" else 1e300)
    return dtypes.cast_to(np.where(np.isfinite(x), np.clip(x, -big, big), x), dtype)


def matmul_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    shape_kind = ch.choice(("edge", "edge", "edge", "tall", "wide", "deep", "long"))
    if shape_kind == "tall":
        m, k, n = ch.choice((257, 1000)), ch.choice((1, 3, 5)), ch.choice((1, 3, 17))
    elif shape_kind == "wide":
        m, k, n = ch.choice((1, 3)), ch.choice((5, 17)), ch.choice((513, 1000))
    elif shape_kind == "deep":
        m, k, n = ch.choice((2, 9)), ch.choice((700, 2049)), ch.choice((2, 33))
    elif shape_kind == "long":
        m, k, n = ch.choice((1, 3, 9)), ch.choice(LONG_K), ch.choice((1, 5, 33))
    else:
        m, k, n = ch.choice(EDGE_SIZES), ch.choice(EDGE_SIZES), ch.choice(EDGE_SIZES)
    ba, bb = _batch_pair(ch) if shape_kind != "long" and ch.boolean(0.4) else ((), ())
    scale = ch.choice((1.0, 1e-3, 30.0)) if dtype != "float16" else ch.choice((1.0, 1e-2, 4.0))
    if dtype == "float16" and k > 1000:
        scale = min(scale, 1.0)  # sums of 16384 products stay inside fp16's range
    values = ch.choice(MATMUL_VALUES)
    a, b = matmul_values(rng, values, ba + (m, k), bb + (k, n), dtype, scale)
    return Case({"a": a, "b": b}, {}, f"{shape_kind}, {values}")


def softmax_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    n = ch.choice((1, 2, 15, 16, 17, 255, 256, 257, 1000, 4097))
    rank = ch.choice((1, 2, 2, 3))
    others = [ch.choice((1, 2, 3, 7, 16)) for _ in range(rank - 1)]
    axis_pos = ch.choice(range(rank))
    shape = others[:axis_pos] + [n] + others[axis_pos:]
    axis = axis_pos - rank if ch.boolean() else axis_pos
    kind = ch.choice(("normal", "offset", "wide", "neginf", "posinf", "range"))
    scale, offset = 1.0, 0.0
    if kind == "offset":
        offset = ch.choice((1e4, -1e4, 300.0))
    elif kind == "wide":
        scale = ch.choice((10.0, 100.0))
    elif kind == "range":
        scale = {"float16": 2e4, "bfloat16": 1e30, "float32": 1e30, "float64": 1e200}[dtype]
    x = _normal(rng, tuple(shape), dtype, scale, offset)
    if kind == "neginf":
        x = x.copy()
        x[rng.random(x.shape) < 0.2] = -np.inf
        if x.size and ch.boolean():
            idx = [slice(None)] * rank
            for d in range(rank):
                if d != axis_pos:
                    idx[d] = 0  # type: ignore[call-overload]
            x[tuple(idx)] = -np.inf  # one fully -inf row -> zeros
    if kind == "posinf" and x.size:  # +inf in a row makes the row NaN, as in the oracle
        x = x.copy()
        x[rng.random(x.shape) < 0.01] = np.inf
        x.reshape(-1)[int(rng.integers(x.size))] = np.inf
        if ch.boolean(0.3):
            x[rng.random(x.shape) < 0.1] = -np.inf
    return Case({"x": x}, {"axis": axis}, kind)


def attention_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    b = ch.choice((1, 2))
    hkv = ch.choice((1, 2))
    hq = hkv * ch.choice((1, 2, 3))
    sq = ch.choice((1, 2, 15, 16, 17, 31, 33, 64, 65, 100))
    sk = sq if ch.boolean(0.3) else ch.choice((1, 2, 16, 17, 32, 33, 65, 100))
    d = ch.choice(HEAD_DIMS)
    dv = d if ch.boolean(0.7) else ch.choice((16, 40))
    causal = ch.boolean(0.4)
    scale = None if ch.boolean(0.6) else ch.choice((0.05, 0.5, 2.0))
    # numerics: plain N(0, 1) values in a third of the cases; else NaN/+-inf entries, scales
    # log-uniform over [1e-30, 1e30] or at the overflow edge, magnitudes up to 1e4, or values
    # near the storage type's range (attention.py: the semantics and the range rule)
    kind = ch.choice(ATTENTION_VALUES)
    mag = ch.choice((1e2, 1e4)) if kind == "magnitude" else 1.0
    shapes = {"q": (b, hq, sq, d), "k": (b, hkv, sk, d), "v": (b, hkv, sk, dv)}
    x = {n: _normal(rng, shp, dtype, mag) for n, shp in shapes.items()}
    if kind == "range":
        x = _attention_range_values(ch, rng, shapes, dtype)
        if dtype != "float16":  # q or k near the limit: q . k overflows unless scaled first
            scale = ch.choice((1e-3, 1e-6, 1e-12))
    note = kind
    if kind == "scale":
        edge = ch.choice((None, None, 0.5, 0.9, 4.0))
        if edge is None:
            scale = float(10.0 ** rng.uniform(-30.0, 30.0))
        else:  # the largest sum of |scale q_d k_d| at edge x the compute type's max
            big = float(np.finfo(np.float64 if dtype == "float64" else np.float32).max)
            kk = np.repeat(np.abs(x["k"].astype(np.float64)), hq // hkv, axis=1)
            qk = np.matmul(np.abs(x["q"].astype(np.float64)), np.swapaxes(kk, -1, -2))
            top = float(qk.max()) if qk.size else 0.0
            scale = min(edge * big / top, 1e300) if top > 0 else 1.0
            note += f" edge {edge}"
    if kind == "nonfinite":
        note += _attention_nonfinite(ch, rng, x)
    mask = None
    if causal:
        note += " causal"
    if ch.boolean(0.4):
        mshape = ch.choice(((sq, sk), (b, 1, sq, sk), (1, hq, 1, sk), (b, hq, sq, sk)))
        mask = rng.random(mshape) < 0.7
        if ch.boolean(0.5) and len(mshape) >= 2 and mshape[-2] == sq:
            mask[..., 0, :] = False  # a fully masked row must give 0, whatever v holds
        if ch.boolean(0.5) and len(mshape) >= 2 and mshape[-2] == sq and sq > 1:
            mask[..., 1, :] = False  # a row that attends exactly one key
            mask[..., 1, int(rng.integers(sk))] = True
        note += " mask" + str(mshape)
    return Case({"q": x["q"], "k": x["k"], "v": x["v"], "mask": mask},
                {"causal": causal, "scale": scale}, note.strip())


ATTENTION_VALUES = ("plain", "plain", "nonfinite", "nonfinite", "scale", "magnitude", "range")
_STORAGE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
                "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}


def _attention_range_values(ch: Chooser, rng: np.random.Generator,
                            shapes: dict[str, tuple[int, ...]], dtype: str
                            ) -> dict[str, np.ndarray]:
    """Values near the storage type's range. float16: q, k and v up to +-65504 (the scores,
    computed in float32, stay in range). Wider types: q or k (the other N(0, 1)) up to the
    type's max, so q . k overflows float32 unless the scale is folded into q first; v up to
    1e35, so the fused kernels' unnormalised sums over 100 keys stay inside float32."""
    top = _STORAGE_MAX[dtype]
    if dtype == "float16":
        spread = dict.fromkeys(shapes, top / 3)
    else:
        big = ch.choice(("q", "k"))
        spread = {"q": 1.0, "k": 1.0, "v": 1e35 / 3}
        spread[big] = min(top, 3e38) / 3
    out = {}
    for n, shp in shapes.items():
        y = np.clip(rng.standard_normal(shp) * spread[n], -top, top)
        y[rng.random(shp) < 0.05] = top  # some entries exactly at the limit
        out[n] = dtypes.cast_to(y, dtype)
    return out


def _attention_nonfinite(ch: Chooser, rng: np.random.Generator, x: dict[str, np.ndarray]) -> str:
    """NaN and +-inf entries in q, k and v (in place), and sometimes a q row whose every score
    is -inf (+inf at q[..., i, d], k[..., :, d] negative): a row with nothing to attend."""
    notes = []
    for _ in range(ch.choice((1, 2, 3))):
        name = ch.choice(("q", "k", "v"))
        value = ch.choice((np.nan, np.inf, -np.inf))
        a = x[name]
        if a.size:
            a[tuple(int(rng.integers(n)) for n in a.shape)] = value
            notes.append(f"{name}={value}")
    q, k = x["q"], x["k"]
    if ch.boolean(0.3) and q.size and k.size:
        i, dd = int(rng.integers(q.shape[2])), int(rng.integers(q.shape[3]))
        q[:, :, i, dd] = np.inf
        k[:, :, :, dd] = -np.abs(np.where(k[:, :, :, dd] == 0, 1, k[:, :, :, dd]))
        notes.append(f"row {i} scores -inf")
    return " " + " ".join(notes)


CaseGenerator = Callable[[Chooser, str], Case]


class _CaseTable(dict[str, CaseGenerator]):
    """The built-in generators by op name; any other registered op falls back to its spec's
    generator (``case_generator``), so ``CASES[op]`` works for every op in the registry."""

    def __missing__(self, op: str) -> CaseGenerator:
        from .ops import OPS

        spec = OPS.get(op)
        gen = case_generator(spec) if spec is not None else None
        if gen is None:
            raise KeyError(op)
        return gen

    def get(self, op: str, default: CaseGenerator | None = None  # type: ignore[override]
            ) -> CaseGenerator | None:
        try:
            return self[op]
        except KeyError:
            return default


CASES: dict[str, CaseGenerator] = _CaseTable({
    "matmul": matmul_case,
    "softmax": softmax_case,
    "attention": attention_case,
})


def register_cases(op: str, fn: CaseGenerator) -> None:
    """Give an op a case generator that takes precedence over its spec's `cases` field."""
    CASES[op] = fn


def case_generator(spec: Any) -> CaseGenerator | None:
    """The generator the suite and `portakern check` use for a spec, first found of:
    register_cases / the built-in table (by name), ``spec.cases``, one derived from
    ``spec.shapes`` or ``spec.example`` (portakern.spec_tools.derived_cases); else None."""
    got = dict.get(CASES, spec.name) or getattr(spec, "cases", None)
    if got is not None:
        return got
    from .spec_tools import derived_cases

    return derived_cases(spec)


def compare(spec: Any, case: Case, got: Any) -> Any:
    """Check a backend's output against the float64 oracle: the op's worst-case bound and its
    statistical check (portakern.verify, the one code path behind pk.verify, the suite and
    `portakern check`). Returns a portakern.verify.Verdict."""
    from .verify import compare_arrays

    arrays, params = spec.bind((), {k: v for k, v in case.arrays.items()} | case.params)
    return compare_arrays(spec, arrays, params, got)

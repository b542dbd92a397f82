"""rmsnorm(x, weight, eps=1e-6): y = x / sqrt(mean(x^2, last axis) + eps) * weight, fused.

The fourth op, written only with the public spec API (portakern.core.spec, portakern.tools.cases,
portakern.core.dtypes, portakern.register_op) exactly as a user would write their own: nothing in
the backends, tests or CLI names it. ``weight`` has shape (N,) with N = x.shape[-1] and x's
dtype (mixed dtypes are refused, as everywhere); float16/bfloat16 accumulate in float32.

Semantics. Written in a scaled form so that no compute type overflows where the result is
representable: with m = max|x| over the row and s = m clamped to [1, 2^-6/tiny],
y = (x/s) / sqrt(mean((x/s)^2) + eps/s^2) * w, which equals the textbook formula. (The C
kernel reaches the same with exact power-of-two scalings instead of a max pass; see
rmsnorm.c.) A row containing inf or NaN gives a NaN row; a row of zeros gives zeros.

Error analysis (the ``tolerance`` rule). Let S = sum x_j^2, ms = S/n, q = ms + eps, r = sqrt(q),
y_j = x_j w_j / r; u is the unit roundoff of the compute type, u_out of the output (storage)
type, sigma the smallest positive *normal* number of the compute type (not the smallest
subnormal: XLA on CPUs flushes subnormal results to zero, which errs by up to sigma, and reads
subnormal inputs as zero).

* Each square rounds with relative error u; a square that underflows errs by at most sigma
  absolutely. The kernel's power-of-two scalings are exact except when they underflow (again
  at most sigma). The XLA form's x/s rounds (2u if XLA rewrites it as x * (1/s)), which moves
  each square by 4u more. Summing n non-negative terms in any order (strided partial sums and
  a tree, or XLA's order) costs at most gamma_{n-1} ~ (n-1)u relative (Higham, Accuracy and
  Stability, 4.2). So |S^ - S| <= (n+5) u S + n sigma.
* Dividing by n, rounding eps to the compute type and adding it: u each, so
  |q^ - q| <= (n+6) u ms + sigma + 2u q. Because eps >= sigma (validated), q is normal; with
  the default eps the sigma term is negligible, and only for eps near sigma (where flushing to
  zero really does lose the squares) does it dominate the bound.
* sqrt halves q's relative error and adds its own (OpenCL allows 3 ulp = 6u; CUDA and XLA round
  correctly); the reciprocal or division adds <= 2.5 ulp = 5u; the products x*inv and *w add u
  each (the XLA form: 2u for x/s, u each for the division and *w).
* Rounding to the output type adds u_out.
* A subnormal input read as zero (XLA on CPUs: denormals-are-zero) loses y_j = x_j w_j / r
  whole: |x_j w_j| / r absolutely (< sigma |w_j| / r, r = sqrt(q) >= sqrt(eps)), a floor
  term for those elements only; its square, < sigma^2, is inside the n sigma above.
  (x = 1e-42, eps = 1.2e-38: y = 9.1e-24, and jax:cpu gives 0.) An element that is not
  subnormal keeps the bound above, on every backend.

Hence, relative to |y|: 0.5 ((n+6) u ms + sigma) / q + 16u + u_out (the constants are rounded
up past the 13u counted above to cover second-order terms), plus an absolute floor for outputs
that underflow: the output type's smallest subnormal and sigma (1 + sqrt(n)) (1 + |w|) for
products that underflow in the compute type (the XLA form's x/s can underflow and is then
scaled by at most sqrt(n) |w|), and |x w| / r for subnormal inputs (read as zero).

Cost: per element one square-add (2 flops) and two multiplies; compulsory traffic is x read
once, w read once and y written once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from importlib import resources
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.errors import InvalidArgumentError, ShapeError
from ..core.sampling import Case, Chooser
from ..core.spec import ArrayMeta, Buf, Cost, KernelSpec, Launch, Operand, Problem, Scalar, Tunable

# Blue's scaling constants per compute type (exact powers of two; see rmsnorm.c). big^2 * 2^31
# and (max * down)^2 * 2^31 both stay below the type's largest finite value, and
# (big * down)^2 stays normal, so neither partial sum can overflow or lose a large element.
SCALING: dict[str, tuple[float, float]] = {
    "float32": (2.0**44, 2.0**-82),
    "float64": (2.0**480, 2.0**-540),
}


def semantics(xp: Any, x: Any, weight: Any, eps: float = 1e-6) -> Any:
    """The op against the array API, in the scaled form described in the module docstring."""
    if x.shape[-1] == 0:
        return x * weight
    m = xp.max(xp.abs(x), axis=-1, keepdims=True)
    # s = m clamped to [1, 2^-6 / tiny]: scale down only, and keep 1/s a normal number, since
    # XLA rewrites x / s as x * (1/s) and flushes subnormals to zero on CPUs
    lim = 1.0 / (64.0 * float(xp.finfo(x.dtype).tiny))
    s = xp.minimum(xp.maximum(m, xp.ones_like(m)), xp.full_like(m, lim))
    xs = x / s
    # + (m - m): 0 for a finite row, NaN when the row holds inf or NaN (NaN row, as documented)
    ms = xp.mean(xs * xs, axis=-1, keepdims=True) + (m - m)
    return xs / xp.sqrt(ms + (eps / s) / s) * weight


def check_eps(eps: object, dtype: str) -> float:
    """eps must be a real number that stays a positive normal number in the compute type."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise InvalidArgumentError(
            f"rmsnorm: eps must be a real number; got {type(eps).__name__} {eps!r}. "
            "Pass e.g. eps=1e-6.")
    e = float(eps)
    fi = np.finfo(dtypes.info(dtype).compute)
    if not math.isfinite(e) or e <= 0:
        raise InvalidArgumentError(
            f"rmsnorm: eps must be finite and > 0 (it keeps the denominator away from zero); "
            f"got {e!r}. Pass e.g. eps=1e-6.")
    if not float(fi.tiny) <= e <= float(fi.max):
        raise InvalidArgumentError(
            f"rmsnorm: eps={e!r} is not a normal number of the {fi.dtype} compute type used for "
            f"{dtype} inputs; expected {float(fi.tiny):.3g} <= eps <= {float(fi.max):.3g}. "
            "Pass e.g. eps=1e-6.")
    return e


def validate(m: dict[str, ArrayMeta | None], params: dict[str, Any]) -> Problem:
    x, w = m["x"], m["weight"]
    assert x is not None and w is not None  # both operands are required
    if len(x.shape) < 1:
        raise ShapeError("rmsnorm: x must have rank >= 1 (normalised over its last axis); got "
                         f"a scalar of shape {x.shape}. Pass x.reshape(1).")
    n = x.shape[-1]
    if tuple(w.shape) != (n,):
        raise ShapeError(
            f"rmsnorm: weight must have shape ({n},), matching x's last axis (x has shape "
            f"{x.shape}); got {tuple(w.shape)}. Pass a 1-D weight of length {n}.")
    dt = dtypes.dtype_name(x.dtype)
    params["eps"] = check_eps(params["eps"], dt)
    rows = int(np.prod(x.shape[:-1]))
    return Problem("rmsnorm", dt, {"x": tuple(x.shape), "weight": (n,)}, params, tuple(x.shape),
                   derived={"rows": rows, "n": n}, empty_result=rows * n == 0)


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    big, down = SCALING[p.info.compute.name]
    return [Launch("rmsnorm", (p.derived["rows"], 1, 1), (cfg["WG"], 1, 1),
                   (Buf("x"), Buf("weight"), Buf("out"), Scalar(p.derived["n"]),
                    Scalar(p.params["eps"], "acc"), Scalar(big, "acc"), Scalar(down, "acc")))]


def cost(p: Problem) -> Cost:
    rows, n = p.derived["rows"], p.derived["n"]
    numel = rows * n
    return Cost(flops=4.0 * numel + 3.0 * rows,
                bytes=float(2 * numel + n) * p.info.storage.itemsize)


def _read_as_zero(xv: np.ndarray, w: np.ndarray, sigma: float, r: np.ndarray) -> np.ndarray:
    """|x_j w_j| / r where x_j is subnormal in the compute type (XLA on CPUs reads it as 0,
    losing y_j whole), else 0: only those elements are loosened, so a row of ordinary values
    keeps its bound (module docstring)."""
    xa = np.abs(np.asarray(xv, dtype=np.float64))
    return np.where(xa < sigma, xa * np.abs(np.asarray(w, dtype=np.float64)) / r, 0.0)


def tolerance(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> np.ndarray:
    """The bound derived in the module docstring, evaluated in float64 on the inputs."""
    xv, w = x["x"], x["weight"]
    n, eps = p.derived["n"], p.params["eps"]
    ci = np.finfo(p.info.compute)
    u, sigma = float(ci.eps) / 2, float(ci.tiny)  # tiny: flush-to-zero allowed (docstring)
    with np.errstate(all="ignore"):
        # ms / q and sigma / q, computed scaled like the semantics so float64 cannot overflow
        s = np.maximum(np.max(np.abs(xv), axis=-1, keepdims=True), 1.0)
        ms_s = np.mean((xv / s) ** 2, axis=-1, keepdims=True)
        q_s = ms_s + eps / s / s
        rel = 0.5 * ((n + 6) * u * ms_s + sigma / s / s) / q_s + 16 * u + p.info.unit_roundoff
        floor = (p.info.subnormal + sigma * (1 + math.sqrt(n)) * (1 + np.abs(w))
                 + _read_as_zero(xv, w, sigma, s * np.sqrt(q_s)))
        bound = np.abs(ref) * rel + floor
    # rows with inf/NaN must be NaN on both sides (compare() accepts that); bound 0 there
    return np.nan_to_num(bound, nan=0.0, posinf=0.0)


def statistical(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> Any:
    """Probabilistic model (the statistical check, portakern.verify), from the analysis above.

    * random (sub-Gaussian, variance proxy sigma^2): S = sum x_j^2 is n - 1 additions of
      partial sums of non-negative terms (each <= S) plus n squares (each <= S), every one
      rounding independently with error <= u |value| (Higham & Mary 2019), in any order: S's
      relative error has proxy u^2 (2n - 1) <= 2 n u^2; it reaches y through q = S/n + eps
      halved by the square root: 0.5 (ms / q) sqrt(2n) u relative. Output rounding: u_out |y|.
    * deterministic (slack): everything else in the worst-case bound, none of it growing
      with n: 0.5 (6 u ms + sigma) / q + 16 u relative, and the absolute floor.

    A row shares its sum, so its elements form one group."""
    from ..core.statmodel import StatModel

    xv, w = x["x"], x["weight"]
    n, eps = p.derived["n"], p.params["eps"]
    ci = np.finfo(p.info.compute)
    u, sigma_min = float(ci.eps) / 2, float(ci.tiny)
    with np.errstate(all="ignore"):
        s = np.maximum(np.max(np.abs(xv), axis=-1, keepdims=True), 1.0)
        ms_s = np.mean((xv / s) ** 2, axis=-1, keepdims=True)
        q_s = ms_s + eps / s / s
        y = np.abs(np.nan_to_num(ref, nan=0.0))
        sig = y * np.sqrt((0.5 * ms_s / q_s) ** 2 * 2.0 * n * u * u + p.info.unit_roundoff ** 2)
        rel = 0.5 * (6 * u * ms_s + sigma_min / s / s) / q_s + 16 * u
        floor = (p.info.subnormal + sigma_min * (1 + math.sqrt(n)) * (1 + np.abs(w))
                 + _read_as_zero(xv, w, sigma_min, s * np.sqrt(q_s)))
        slack = y * rel + floor
    return StatModel(np.nan_to_num(sig, nan=np.inf), np.nan_to_num(slack, nan=np.inf), (-1,))


# --- cases: shapes that break the kernel, values that break the numerics ------------------
ROW_SIZES = (1, 2, 3, 5, 7, 15, 16, 17, 31, 63, 64, 65, 127, 255, 256, 257, 1000, 1023, 4097)
BATCHES: tuple[tuple[int, ...], ...] = ((), (1,), (3,), (2, 3), (9,))
# per storage dtype: (large, small, huge-element) magnitudes. large/huge overflow the compute
# type's squares for fp32/bf16/fp64 (the kernel's scaled path); small underflows them; fp16's
# range is narrower, so its squares never overflow fp32 but its small values are subnormal.
MAGNITUDES: dict[str, tuple[float, float, float]] = {
    "float16": (1e4, 1e-4, 3e4),
    "bfloat16": (1e25, 1e-22, 1e30),
    "float32": (1e25, 1e-22, 1e30),
    "float64": (1e200, 1e-170, 1e250),
}


def cases(ch: Chooser, dtype: str) -> Case:
    """One rmsnorm call: edge row lengths (1, primes, work-group sizes +- 1), batches, and
    values at the ends of the dtype's range, zero rows and non-finite entries."""
    rng = np.random.default_rng(ch.seed())
    n = ch.choice(ROW_SIZES)
    shape = ch.choice(BATCHES) + (n,)
    eps = ch.choice((1e-6, 1e-6, 1e-5, 0.1))
    kind = ch.choice(("normal", "normal", "offset", "large", "small", "eps", "mixed", "zero_row",
                      "nonfinite", "subnormal"))
    large, small, huge = MAGNITUDES[dtype]
    if kind == "subnormal":  # subnormal storage values, eps the least allowed: y is normal
        small = float(np.finfo(np.float16).tiny if dtype == "float16" else
                      np.finfo(dtypes.info(dtype).compute).tiny) / 100
        eps = float(np.finfo(dtypes.info(dtype).compute).tiny)
    scale = {"large": large, "small": small, "eps": math.sqrt(eps), "subnormal": small
             }.get(kind, 1.0)
    offset = (100.0 if dtype == "float16" else 1e3) if kind == "offset" else 0.0
    x = rng.standard_normal(shape) * scale + offset
    if kind == "mixed":  # a few huge elements beside ordinary ones: both of the kernel's sums
        x = np.where(rng.random(shape) < 0.05, huge * np.sign(x), x)
    if kind == "zero_row":
        x.reshape(-1, n)[0] = 0.0
    if kind == "nonfinite":
        flat = x.reshape(-1, n)
        flat[0, int(rng.integers(n))] = ch.choice((np.inf, -np.inf, np.nan))
    fmax = float(np.finfo(np.float16).max) if dtype == "float16" else math.inf
    x = dtypes.cast_to(np.where(np.isfinite(x), np.clip(x, -fmax, fmax), x), dtype)
    wkind = ch.choice(("ones", "normal", "small", "wide"))
    if wkind == "ones":
        w = np.ones(n)
    else:
        w = rng.standard_normal(n) * {"normal": 1.0, "small": 0.1, "wide": 3.0}[wkind]
    return Case({"x": x, "weight": dtypes.cast_to(w, dtype)}, {"eps": eps}, f"{kind}, w {wkind}")


def example(dtype: str) -> tuple[dict[str, object], dict[str, Any]]:
    """A typical LLM call (64 tokens, hidden size 4096): what `portakern show` renders."""
    return ({"x": ArrayMeta((64, 4096), dtype), "weight": ArrayMeta((4096,), dtype)},
            {"eps": 1e-6})


def _source() -> str:
    """The .c kernel shipped beside this module (package data)."""
    return resources.files(__package__ or "portakern.ops").joinpath("rmsnorm.c").read_text()


SPEC = KernelSpec(
    name="rmsnorm",
    operands=(Operand("x"), Operand("weight")),
    params={"eps": 1e-6},
    validate=validate,
    semantics=semantics,
    source=_source(),
    slots=lambda p: {"T": p.dtype},
    defines=lambda p, cfg: dict(cfg),
    launches=launches,
    cost=cost,
    tolerance=tolerance,
    statistical=statistical,
    tunables=(Tunable("WG", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                      "work-items per row (a power of two: tree reduction)"),
              Tunable("VEC", (1, 2, 4, 8, 16), "vector lanes per load (OpenCL, float32 and "
                      "float64 storage; 1 elsewhere: the scalar loop)")),
    # CPU: one item per row, reading it in 8-lane vectors (the scalar loop's branch, Blue's
    # split, keeps PoCL's and Intel's vectorizers off it). Measured side by side on a quiet
    # 2-core Xeon, PoCL / Intel, WG/VEC = 1/8 against the old 4/1 and against 4/8: 64x4096
    # 168 / 45 us (327 / 303; 120 / 51), 4096x4096 13.9 / 7.6 ms (26.2 / 25.5; 11.7 / 11.7),
    # 16384x1024 8.0 / 9.0 ms (29.9 / 31.1; 16.2 / 10.0). GPU: 256 items per row, so a
    # 4096-wide row is 16 coalesced loads per item and the tree has 8 levels.
    schedules={"gpu": {"WG": 256, "VEC": 1}, "cpu": {"WG": 1, "VEC": 8}},
    example=example,
    cases=cases,
    doc="Fused RMSNorm with a weight over the last axis; fp32 accumulation for fp16/bf16.",
)

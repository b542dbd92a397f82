"""The numpy/BLAS peer, run in its own process: ``python -m portakern.bench.numpy_worker``.

Why a separate process: OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE may be set on these machines
(tests and CI keep them), and they pin OpenBLAS to a slower kernel — roughly half the speed
of what it picks itself. OpenBLAS reads them once, when numpy is imported, so the only
honest peer is a process started without them. This process reports which BLAS, which
kernel ("architecture", from threadpoolctl) and how many threads it used, and which of those
variables it saw, so the result file proves the peer was not handicapped.

Protocol (JSON lines on stdin/stdout): it first prints a ``hello`` record (which also lists
the ops this process knows, with where their semantics are defined); then for each request
``{"case": ..., "timing": ...}`` it rebuilds the case's inputs from its seed
(suites.make_inputs: the same arrays the other implementations get), times the numpy
expression and prints ``{"kind": "result", "measurement": ...}``. EOF ends it.

The numpy expression is hand-written for matmul, softmax and attention (what a numpy user
writes: BLAS matmul, an in-place softmax); any other op is timed as its own
``spec.semantics(numpy, ...)`` (semantics_peer.py). This process sees the built-in ops and the
``portakern.ops`` entry-point plugins; an op registered in the parent's code is not here, and
the parent runs its numpy peer itself (peers.py says so in the record).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

# variables that change which BLAS kernel or how many threads run
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "GOTO_NUM_THREADS", "BLIS_NUM_THREADS")
NUMPY_DTYPES = ("float32", "float64")  # BLAS-backed; numpy's fp16 matmul is a plain C loop


def blas_info() -> dict[str, Any]:
    """BLAS libraries numpy loaded, with kernel ('architecture') and thread count."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError as exc:
        return {"error": f"threadpoolctl is not importable ({exc}); pip install threadpoolctl"}
    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not libs:
        return {"error": "threadpoolctl found no BLAS library loaded by numpy"}
    lib = libs[0]
    return {"name": lib.get("internal_api"), "version": lib.get("version"),
            "architecture": lib.get("architecture"), "threads": lib.get("num_threads"),
            "threading_layer": lib.get("threading_layer"), "filepath": lib.get("filepath"),
            "all": libs}


def _softmax_inplace(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def build(case: dict[str, Any], x: dict[str, np.ndarray]) -> Callable[[], object]:
    """The plain numpy expression of a case (what a numpy user would write)."""
    op, params = case["op"], case.get("params") or {}
    if op == "matmul":
        a, b = x["a"], x["b"]
        return lambda: np.matmul(a, b)
    if op == "softmax":
        xs = x["x"]

        def softmax() -> np.ndarray:
            return _softmax_inplace(xs - xs.max(axis=-1, keepdims=True))

        return softmax
    if op == "attention":
        q, k, v = x["q"], x["k"], x["v"]
        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        g = Hq // Hkv
        scale = params.get("scale") or (1.0 / math.sqrt(D))
        qg = q.reshape(B, Hkv, g * Sq, D)
        kt = np.swapaxes(k, -1, -2)
        causal = bool(params.get("causal"))
        drop = None
        if causal:
            i = np.arange(g * Sq)[:, None] % Sq
            drop = i < np.arange(Sk)[None, :]

        def attention() -> np.ndarray:
            s = np.matmul(qg, kt)
            s *= q.dtype.type(scale)
            if drop is not None:
                s[..., drop] = -np.inf
            p = _softmax_inplace(s)
            return np.matmul(p, v).reshape(B, Hq, Sq, v.shape[-1])

        return attention
    raise ValueError(f"numpy peer: no expression for op {op!r}; expected matmul, softmax or "
                     "attention. Add one to portakern/bench/numpy_worker.py.")


def known_ops() -> dict[str, str]:
    """Registered ops of this process -> where their semantics are defined."""
    from ..ops import OPS
    from .semantics_peer import identity

    return {name: identity(spec) for name, spec in OPS.items()}


def semantics_peer(case: Any, x: dict[str, np.ndarray | None]) -> tuple[Callable[[], object],
                                                                          str]:
    """(callable, what) of an op without a hand-written numpy expression: its semantics."""
    from ..ops import get_op
    from .semantics_peer import semantics_call, what

    spec = get_op(case.op)
    arrays = [x[o.name] for o in spec.operands]
    prob = spec.problem(*spec.bind(arrays, dict(case.params)))  # validated, defaults filled
    fn = semantics_call(spec, np, arrays, prob.params, case.dtype)
    return fn, what(spec, "numpy", case.dtype) + (" in the numpy peer process (started without "
                                                  "OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE)")


def handle(req: dict[str, Any]) -> dict[str, Any]:
    from .semantics_peer import has_handwritten_peers
    from .suites import Case, make_inputs
    from .timing import TimingConfig, measure, not_run

    case = Case.from_dict(req["case"])
    if not has_handwritten_peers(case.op):
        fn, text = semantics_peer(case, make_inputs(case))
        with np.errstate(all="ignore"):
            m = measure(fn, lambda: None, TimingConfig(**req["timing"]), what=text)
        return {"kind": "result", "measurement": m.as_dict()}
    what = {"matmul": "np.matmul(a, b)",
            "softmax": "numpy max-subtracted exp / sum along the last axis",
            "attention": "np.matmul(q, k^T) * scale -> numpy softmax -> np.matmul(p, v) "
                         "(GQA by reshape)"}.get(case.op, case.op)
    if case.dtype not in NUMPY_DTYPES:
        m = not_run("unavailable", f"the numpy peer runs {', '.join(NUMPY_DTYPES)} only: for "
                    f"{case.dtype} numpy has no BLAS (its matmul is a plain C loop) and its "
                    "ufuncs compute in the 16-bit type, so it is not a native fast path", what)
        return {"kind": "result", "measurement": m.as_dict()}
    x = make_inputs(case)
    fn = build(case.as_dict(), x)
    m = measure(fn, lambda: None, TimingConfig(**req["timing"]), what=what)
    return {"kind": "result", "measurement": m.as_dict()}


def main() -> int:
    env = {k: os.environ.get(k) for k in BLAS_ENV}
    try:
        ops: dict[str, str] | str = known_ops()
    except Exception as exc:  # the hand-written peers still work without the registry
        ops = f"{type(exc).__name__}: {exc}"
    hello = {"kind": "hello", "pid": os.getpid(), "numpy": np.__version__, "blas": blas_info(),
             "env": env, "python": sys.version.split()[0], "ops": ops}
    out = sys.stdout
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = handle(json.loads(line))
        except KeyboardInterrupt:
            return 130
        except Exception as exc:  # report, keep serving: one failing case must not end the run
            reply = {"kind": "error", "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent reports
        sys.exit(130)

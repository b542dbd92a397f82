"""The numpy/BLAS peer, run in its own process: ``python -m portakern.tools.bench.numpy_worker``.

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
expression and prints ``{"kind": "result", "measurement": ...}``. EOF ends it. For the
interleaved rounds of the parent (timing.run_rounds), a request with ``"op": "prepare"`` and
an ``id`` does the first call and the warm-up and keeps the callable; ``"op": "sample"``
times one more call of it (``{"kind": "sample", "s": seconds}``); ``"op": "release"`` drops
it. The timed region is this process's own ``perf_counter`` around the call: the pipe is
never timed.

The same process serves the PyTorch CPU peer (``"peer": "torch"`` in the request:
torch.matmul, torch.softmax, the fused scaled_dot_product_attention, the RMSNorm expression,
on tensors sharing the numpy inputs' memory), with torch's intra-op threads set to its cores
and the SDPA kernel that ran recorded from torch's profiler.

The numpy expression is hand-written for matmul, softmax and attention (what a numpy user
writes: BLAS matmul, a softmax subtracting the max once); any other op is timed as its own
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

        def softmax() -> np.ndarray:  # the max is subtracted once, into the new array
            s = np.subtract(xs, xs.max(axis=-1, keepdims=True))
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            return s

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
    if op == "attention_backward":
        return _numpy_attention_backward(x, params)
    raise ValueError(f"numpy peer: no expression for op {op!r}; expected matmul, softmax, "
                     "attention or attention_backward. Add one to "
                     "portakern/tools/bench/numpy_worker.py.")


def _numpy_attention_backward(x: dict[str, np.ndarray], params: dict[str, Any]
                              ) -> Callable[[], object]:
    """The unfused backward a numpy user writes (non-causal, unmasked): P = exp(scale q k^T -
    lse) from the forward's lse, dV = P^T dO, dP = dO V^T, delta = rowsum(dO * O),
    dS = P * (dP - delta), dQ = scale dS K, dK = scale dS^T Q; GQA by reshape (the group's
    rows side by side, so dK and dV sum over the group in the matmul)."""
    do, q, k, v, o, lse = (x[n] for n in ("do", "q", "k", "v", "o", "lse"))
    if params.get("causal") or x.get("mask") is not None:
        raise ValueError("numpy peer: the hand-written attention backward is non-causal and "
                         "unmasked only")
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    R = (Hq // Hkv) * Sq
    scale = q.dtype.type(params.get("scale") or (1.0 / math.sqrt(D)))
    qg, dog, og = (a.reshape(B, Hkv, R, a.shape[-1]) for a in (q, do, o))
    lseg = lse.reshape(B, Hkv, R, 1).astype(q.dtype)
    kt, vt = np.swapaxes(k, -1, -2), np.swapaxes(v, -1, -2)

    def attention_backward() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = np.matmul(qg, kt)
        p *= scale
        p -= lseg
        np.exp(p, out=p)  # P
        dv = np.matmul(np.swapaxes(p, -1, -2), dog)
        ds = np.matmul(dog, vt)  # dP
        ds -= np.sum(dog * og, axis=-1, keepdims=True)  # delta
        ds *= p  # dS
        dq = np.matmul(ds, k)
        dq *= scale
        dk = np.matmul(np.swapaxes(ds, -1, -2), qg)
        dk *= scale
        return dq.reshape(B, Hq, Sq, D), dk, dv.reshape(B, Hkv, Sk, Dv)

    return attention_backward


TORCH_OPS = ("matmul", "softmax", "attention", "attention_backward", "rmsnorm",
             "paged_attention")
TORCH_WHAT = {
    "matmul": "torch.matmul(a, b) on CPU tensors sharing the numpy inputs' memory",
    "softmax": "torch.softmax(x, dim=-1)",
    "attention": "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=..., "
                 "scale=..., enable_gqa=Hq != Hkv): torch's fused CPU SDPA where it applies",
    "attention_backward": "torch autograd of F.scaled_dot_product_attention(q, k, v, scale=..., "
                          "enable_gqa=Hq != Hkv): the forward run once untimed, each timed call "
                          "torch.autograd.grad(out, (q, k, v), do, retain_graph=True): the "
                          "backward alone (torch's fused CPU SDPA backward where it applies)",
    "rmsnorm": "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight (the LLaMA "
               "RMSNorm module's expression; torch 2.13's F.rms_norm took ~30 ms for 64x4096 "
               "here, 100x slower, so it would flatter us)",
    "paged_attention": "the pages gathered by indexing, k_cache[block_table] (an fp16 cache "
                       "gathered in fp16, then cast to float32: torch's CPU SDPA has no fast "
                       "fp16 path), then F.scaled_dot_product_attention(q, k, v, scale=..., "
                       "enable_gqa=True): every sequence of the benchmark full and Sq = 1, so "
                       "no mask is needed",
}
_TORCH: dict[str, Any] = {}


def torch_setup() -> tuple[Any, dict[str, Any]]:
    """Import torch once, with as many intra-op threads as this process may use cores (the
    machine's, unless an affinity mask says fewer); return (torch, what to record)."""
    if "torch" not in _TORCH:
        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        torch.set_num_threads(cores)
        info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "cores": cores, "interop_threads": torch.get_num_interop_threads(),
                "mkldnn": bool(torch.backends.mkldnn.is_available()),
                "mkl": bool(torch.backends.mkl.is_available()),
                "cpu_capability": _torch_capability(torch)}
        _TORCH["torch"], _TORCH["info"] = torch, info
    return _TORCH["torch"], dict(_TORCH["info"])


def _torch_capability(torch: Any) -> str | None:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return None


def sdpa_kernels(torch: Any, fn: Callable[[], object]) -> list[str]:
    """The aten attention kernels one call of ``fn`` ran (torch.profiler, CPU activities):
    ``aten::_scaled_dot_product_flash_attention_for_cpu`` is the fused flash kernel,
    ``aten::_scaled_dot_product_attention_math`` the unfused fallback."""
    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved = os.dup(2)  # the profiler's C++ side logs start/stop lines to fd 2: keep them out
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names
                  if "attention" in n and n != "aten::scaled_dot_product_attention")


def _torch_view(torch: Any, v: np.ndarray) -> Any:
    """The array as a torch tensor with no copy; ml_dtypes' bfloat16 (which torch.from_numpy
    does not take) through its bits: a uint16 view, viewed as torch.bfloat16."""
    if v.dtype.name == "bfloat16":
        return torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(v)


def build_torch(case: Any, x: dict[str, np.ndarray | None]) -> tuple[Callable[[], object],
                                                                    dict[str, Any]]:
    """(callable, info) of the PyTorch CPU expression of a case (what a torch user writes)."""
    torch, info = torch_setup()
    F = torch.nn.functional
    t = {k: _torch_view(torch, v) for k, v in x.items() if v is not None}
    op, params = case.op, case.params or {}
    if op == "matmul":
        a, b = t["a"], t["b"]

        def fn() -> object:
            return torch.matmul(a, b)
    elif op == "softmax":
        xs = t["x"]

        def fn() -> object:
            return torch.softmax(xs, dim=-1)
    elif op == "attention":
        q, k, v = t["q"], t["k"], t["v"]
        D = q.shape[-1]
        scale = float(params.get("scale") or (1.0 / math.sqrt(D)))
        causal, gqa = bool(params.get("causal")), q.shape[1] != k.shape[1]

        def fn() -> object:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)
        info["sdpa_kernels"] = sdpa_kernels(torch, fn)
        info["enable_gqa"] = gqa
    elif op == "attention_backward":
        q, k, v = (t[n].requires_grad_() for n in ("q", "k", "v"))
        do = t["do"]
        D = q.shape[-1]
        scale = float(params.get("scale") or (1.0 / math.sqrt(D)))
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(params.get("causal")),
                                             scale=scale, enable_gqa=gqa)

        def fn() -> object:
            return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        info["sdpa_kernels"] = sdpa_kernels(torch, fn)
        info["enable_gqa"] = gqa
    elif op == "paged_attention":
        paged = _torch_paged(torch, t, params)

        def fn() -> object:
            return paged()
    elif op == "rmsnorm":
        xs, w = t["x"], t["weight"]
        eps = float(params.get("eps", 1e-6))

        def fn() -> object:
            return xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps) * w
    else:
        raise ValueError(f"torch peer: no expression for op {op!r}; expected one of "
                         f"{', '.join(TORCH_OPS)}.")
    return fn, info


def _torch_paged(torch: Any, t: dict[str, Any], params: dict[str, Any]) -> Callable[[], object]:
    """Decode on the gathered cache (TORCH_WHAT["paged_attention"]): full sequences, Sq = 1."""
    F = torch.nn.functional
    q, kc, vc = t["q"], t["k_cache"], t["v_cache"]
    bt = t["block_table"].long()
    B, Hq, _, D = q.shape
    Hkv, BS = kc.shape[1], kc.shape[2]
    keys = bt.shape[1] * BS
    scale = float(params.get("scale") or (1.0 / math.sqrt(D)))
    up = torch.float32 if q.dtype == torch.float16 else q.dtype

    def fn() -> object:
        k = kc[bt].transpose(1, 2).reshape(B, Hkv, keys, D).to(up)
        v = vc[bt].transpose(1, 2).reshape(B, Hkv, keys, vc.shape[-1]).to(up)
        return F.scaled_dot_product_attention(q.to(up), k, v, scale=scale,
                                              enable_gqa=Hq != Hkv)
    return fn


def known_ops() -> dict[str, str]:
    """Registered ops of this process -> where their semantics are defined."""
    from ...ops import OPS
    from .semantics_peer import identity

    return {name: identity(spec) for name, spec in OPS.items()}


def semantics_peer(case: Any, x: dict[str, np.ndarray | None]) -> tuple[Callable[[], object],
                                                                          str]:
    """(callable, what) of an op without a hand-written numpy expression: its semantics."""
    from ...ops import get_op
    from .semantics_peer import semantics_call, what

    spec = get_op(case.op)
    arrays = [x[o.name] for o in spec.operands]
    prob = spec.problem(*spec.bind(arrays, dict(case.params)))  # validated, defaults filled
    fn = semantics_call(spec, np, arrays, prob.params, case.dtype)
    return fn, what(spec, "numpy", case.dtype) + (" in the numpy peer process (started without "
                                                  "OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE)")


Built = tuple[Callable[[], object], str, dict[str, Any], Any]


def build_request(req: dict[str, Any]) -> Built | dict[str, Any]:
    """(fn, what, info, scope) of a request's peer, or the measurement of a peer that does
    not apply (``not_run`` as a dict). ``scope`` is None or a context factory entered around
    its calls, outside the timed region."""
    from .semantics_peer import has_handwritten_peers
    from .suites import BenchCase, make_inputs
    from .timing import not_run

    case = BenchCase.from_dict(req["case"])
    if req.get("peer") == "torch":
        what = TORCH_WHAT.get(case.op, case.op)
        if case.op not in TORCH_OPS:
            return not_run("not_applicable", f"no torch expression for {case.op}",
                           what).as_dict()
        if case.dtype not in ("float32", "float64", "bfloat16") \
                and case.op != "paged_attention":  # it gathers in fp16, then casts
            return not_run("unavailable", f"torch's CPU kernels for {case.dtype} are not its "
                           "fast path (no fp16 GEMM/SDPA worth comparing on x86)",
                           what).as_dict()
        x = make_inputs(case)
        if case.dtype == "bfloat16":  # (until 2026-12-07 upcast to float32: twice the bytes)
            what += " (bfloat16 tensors, zero-copy views of the inputs' bits)"
        fn, info = build_torch(case, x)
        return fn, what + f", {info['threads']} intra-op threads", info, None
    if not has_handwritten_peers(case.op):
        fn, text = semantics_peer(case, make_inputs(case))
        return fn, text, {}, lambda: np.errstate(all="ignore")
    what = {"matmul": "np.matmul(a, b)",
            "softmax": "numpy max-subtracted exp / sum along the last axis",
            "attention": "np.matmul(q, k^T) * scale -> numpy softmax -> np.matmul(p, v) "
                         "(GQA by reshape)",
            "attention_backward": "numpy unfused backward: P = exp(scale q k^T - lse), "
                                  "dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), "
                                  "dQ = scale dS K, dK = scale dS^T Q (np.matmul; GQA by "
                                  "reshape)"}.get(case.op, case.op)
    if case.dtype not in NUMPY_DTYPES:
        return not_run("unavailable", f"the numpy peer runs {', '.join(NUMPY_DTYPES)} only: "
                       f"for {case.dtype} numpy has no BLAS (its matmul is a plain C loop) and "
                       "its ufuncs compute in the 16-bit type, so it is not a native fast "
                       "path", what).as_dict()
    x = make_inputs(case)
    return build(case.as_dict(), x), what, {}, None


_PREPARED: dict[Any, Any] = {}  # request id -> timing.Prepared, between prepare and release


def handle(req: dict[str, Any]) -> dict[str, Any]:
    """One request. Without ``op``: measure the case's peer on its own (first call, warm-up,
    samples) and reply ``result``. With ``op``, the steps of interleaved rounds driven by the
    parent (timing.run_rounds): ``prepare`` (first call and warm-up; reply ``prepared`` with
    the measurement so far, or ``result`` when the peer does not apply), ``sample`` (one
    timed call of prepared ``id``; reply ``sample`` with its seconds) and ``release``."""
    from .timing import TimingConfig, measure, prepare

    op = req.get("op")
    if op == "sample":
        t = _PREPARED[req["id"]].sample()
        return {"kind": "sample", "s": t}
    if op == "release":
        p = _PREPARED.pop(req["id"], None)
        if p is not None:
            p.close()
        return {"kind": "released", "info": p.m.info if p is not None else {}}
    built = build_request(req)
    if isinstance(built, dict):
        return {"kind": "result", "measurement": built}
    fn, what, info, scope = built
    cfg = TimingConfig(**req["timing"])
    if op == "prepare":
        prep = prepare(fn, lambda: None, cfg, what=what, scope=scope)
        prep.m.info.update(info)
        _PREPARED[req["id"]] = prep
        return {"kind": "prepared", "measurement": prep.m.as_dict()}
    if scope is not None:
        with scope():
            m = measure(fn, lambda: None, cfg, what=what)
    else:
        m = measure(fn, lambda: None, cfg, what=what)
    m.info.update(info)
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

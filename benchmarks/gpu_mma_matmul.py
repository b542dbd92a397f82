"""bf16 matmul N=4096 through the fragment API (docs/fragments.md; MMA=1 is the default on
sm_80+) against cuBLAS (cupy.matmul) on the same GPU; goal: at least 0.5x cuBLAS. Run by
benchmarks/gpu_check.sh when a GPU is lent; writes $OUT_DIR/mma_matmul.json. Never CI."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gpu_timing import cuda_timer, write_figures  # benchmarks/: the script's own folder


def main() -> dict[str, Any]:
    out: dict[str, Any] = {"op": "matmul", "dtype": "bfloat16", "N": 4096,
                           "goal_vs_cublas": 0.5, "tf32": os.environ.get("CUPY_TF32")}
    try:
        import cupy as cp
        import ml_dtypes

        import portakern as pk
        from portakern.ops import get_op
        from portakern.runtime.plan import plan_for

        n = 4096
        rng = np.random.default_rng(0)
        a = cp.asarray(rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16))
        b = cp.asarray(rng.standard_normal((n, n)).astype(ml_dtypes.bfloat16))
        plan = plan_for(get_op("matmul"), (a, b), {}, backend="cuda")
        out["kernels"] = [s.launch.kernel for s in plan.steps]

        timed = cuda_timer(cp)

        ours = timed(lambda: pk.matmul(a, b, backend="cuda"))
        cublas = timed(lambda: cp.matmul(a, b))
        flops = 2.0 * n ** 3
        out.update(portakern_s=ours, cublas_s=cublas,
                   portakern_tflops=flops / ours[0] / 1e12,
                   cublas_tflops=flops / cublas[0] / 1e12,
                   ratio_vs_cublas=cublas[0] / ours[0])
        x = pk.matmul(a, b, backend="cuda").astype(cp.float32)
        y = cp.matmul(a, b).astype(cp.float32)
        out["max_rel_diff_vs_cublas"] = float(cp.abs(x - y).max() / cp.abs(y).max())
        out["meets_goal"] = out["ratio_vs_cublas"] >= out["goal_vs_cublas"]
    except Exception as exc:  # recorded, never raised: the script goes on
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    write_figures(main(), "mma_matmul.json")

"""What the GPU check's figure scripts (gpu_mma_*.py) share: CUDA-event timing (one warm-up
call, then the median, min and max of `reps` event-timed calls, in seconds) and the JSON
writer."""

from __future__ import annotations

from typing import Any

import numpy as np


def cuda_timer(cp: Any) -> Any:
    def timed(fn: Any, reps: int = 10) -> tuple[float, float, float]:
        fn()
        cp.cuda.Device().synchronize()
        ts = []
        for _ in range(reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
        return float(np.median(ts)), float(np.min(ts)), float(np.max(ts))
    return timed


def write_figures(res: dict[str, Any], name: str) -> None:
    """$OUT_DIR/<name> (gpu_check.sh gathers it into results.json), and the same on stdout."""
    import json
    import os

    with open(os.path.join(os.environ.get("OUT_DIR", "."), name), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str))

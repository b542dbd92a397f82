"""Large buffers of a CPU OpenCL device sit on transparent huge pages (backend/opencl.py
``_advise_huge``): without the advice, Linux's default THP mode (madvise) gives a runtime's
buffers 4 KiB pages, and paged decode over a 1 GiB cache ran 1.2-1.35x slower (TLB misses).
Each check runs in a fresh process: the setting is read when the backend opens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portakern.backend import registry

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = r"""
import json, sys
import numpy as np
import pyopencl as cl
import portakern as pk
from portakern.runtime import selection

target = sys.argv[1]
n = 32 << 20  # bytes: several 2 MiB pages whatever the buffer's alignment
x = pk.to_backend(np.ones(n // 4, np.float32), target)
be = selection.get(target)
host, _ev = cl.enqueue_map_buffer(be.queue, x.base_data, cl.map_flags.READ, 0, (1,), np.uint8)
mid = int(host.ctypes.data) + n // 2
host.base.release(be.queue)
huge = None
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and ":" not in head:
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= mid < hi
    elif inside and line.startswith("AnonHugePages:"):
        huge = int(line.split()[1])
assert np.array_equal(x.get(), np.ones(n // 4, np.float32))  # the data is the data
print(json.dumps({"huge_kb": huge}))
"""


def _mode() -> str:
    if sys.platform != "linux" or not THP_MODE.exists():
        return "none"
    text = THP_MODE.read_text()
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


def _cpu_targets() -> list[str]:
    av = registry.availability("opencl")
    if not av.available:
        return []
    return [f"opencl:{d.extra['alias']}" for d in av.devices
            if d.kind == "cpu" and d.extra.get("alias") in ("pocl", "intel")]


def _huge_kb(target: str, setting: str | None) -> int:
    env = dict(os.environ)
    env.pop("PORTAKERN_OPENCL_HUGEPAGES", None)
    if setting is not None:
        env["PORTAKERN_OPENCL_HUGEPAGES"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE, target], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    huge = json.loads(out.stdout.strip().splitlines()[-1])["huge_kb"]
    assert huge is not None, "the buffer's mapping was not found in /proc/self/smaps"
    return int(huge)


@pytest.mark.parametrize("selector", ["opencl:pocl", "opencl:intel"])
def test_large_cpu_buffers_sit_on_huge_pages(selector: str) -> None:
    if selector not in _cpu_targets():
        pytest.skip(f"{selector} is not installed here")
    mode = _mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"this OS offers no transparent huge pages (THP mode {mode!r})")
    assert _huge_kb(selector, None) >= 8 * 1024, "the buffer is not on huge pages"
    if mode == "madvise":  # the advice is what gives them: off, the buffer keeps 4 KiB pages
        assert _huge_kb(selector, "0") == 0

"""portakern.core.codegen: the dialect tables, and hip as cuda with a few fields overridden."""

from __future__ import annotations

import dataclasses
import hashlib

import ml_dtypes
import numpy as np

from portakern.core import codegen

# The fields in which HIP's spelling differs from CUDA's; every other field hip inherits. Ids,
# sizes and the barrier are compiler builtins (no device library needed: gfx1100 builds with
# -nogpulib); matrix_units: MFMA (CDNA) and WMMA (RDNA3) instead of mma.sync.
HIP_OVERRIDES = {"name", "headers", "launch_bounds", "barrier", "group_id", "local_id",
                 "local_size", "num_groups", "matrix_units"}
_HIP_BUILTIN_LINES = ("#define PK_BARRIER() ", "#define PK_GROUP_ID(d) ",
                      "#define PK_LOCAL_ID(d) ", "#define PK_LOCAL_SIZE(d) ",
                      "#define PK_NUM_GROUPS(d) ")


def _preamble(dialect: str) -> str:
    """The rendered preamble for a fixed body, every kind of dtype slot and one define."""
    slots = {"T": np.dtype(np.float16), "U": np.dtype(ml_dtypes.bfloat16),
             "V": np.dtype(np.float32)}
    return codegen.render("/* body */", dialect, slots=slots, defines={"BS": 128})


def test_hip_differs_from_cuda_only_in_its_overrides() -> None:
    cuda, hip = codegen.DIALECTS["cuda"], codegen.DIALECTS["hip"]
    differ = {f.name for f in dataclasses.fields(codegen.Dialect)
              if getattr(cuda, f.name) != getattr(hip, f.name)}
    assert differ == HIP_OVERRIDES
    assert hip.headers == "#include <hip/hip_fp16.h>"
    assert hip.launch_bounds == "__launch_bounds__({n})"


def test_hip_preamble_is_unchanged_by_inheriting() -> None:
    """Pinned from the rendering of the table (re-pinned when ids, sizes and the barrier became
    builtins): the source hipcc compiles is byte for byte the same."""
    text = _preamble("hip")
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "ca70a77efbf1a3e3053360eaa41ed6c64e3b0b22102a398e22fbf942d17e6425")
    # and the rendered lines differ from cuda's exactly where the overridden fields are used
    diff = {ln for ln in set(text.splitlines()) ^ set(_preamble("cuda").splitlines())
            if not ln.startswith(_HIP_BUILTIN_LINES)}
    builtins = [ln for ln in text.splitlines() if ln.startswith(_HIP_BUILTIN_LINES)]
    assert len(builtins) == len(_HIP_BUILTIN_LINES)
    assert all("__builtin_amdgcn_" in ln and "__ockl" not in ln for ln in builtins)
    assert diff == {
        "/* portakern: rendered for hip */", "/* portakern: rendered for cuda */",
        "#include <hip/hip_fp16.h>", "#include <cuda_fp16.h>",
        "#define PK_LAUNCH_BOUNDS(n, m) __launch_bounds__(n)",
        "#define PK_LAUNCH_BOUNDS(n, m) __launch_bounds__(n, m)",
    }

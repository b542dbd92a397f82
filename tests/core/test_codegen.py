"""portakern.core.codegen: the dialect tables, and hip as cuda with a few fields overridden."""

from __future__ import annotations

import dataclasses
import hashlib

import ml_dtypes
import numpy as np

from portakern.core import codegen

# The fields in which HIP's spelling differs from CUDA's; every other field hip inherits.
HIP_OVERRIDES = {"name", "headers", "launch_bounds"}


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
    """Pinned from the rendering of the table that spelled every hip field out (before hip
    was derived from cuda): the source hipcc compiles is byte for byte the same."""
    text = _preamble("hip")
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "697e3a2b0214410a3fca72aee6cbe86bd3adcaff13425e5bf9c94f5e6eca36ca")
    # and the rendered lines differ from cuda's exactly where the overridden fields are used
    diff = set(text.splitlines()) ^ set(_preamble("cuda").splitlines())
    assert diff == {
        "/* portakern: rendered for hip */", "/* portakern: rendered for cuda */",
        "#include <hip/hip_fp16.h>", "#include <cuda_fp16.h>",
        "#define PK_LAUNCH_BOUNDS(n, m) __launch_bounds__(n)",
        "#define PK_LAUNCH_BOUNDS(n, m) __launch_bounds__(n, m)",
    }

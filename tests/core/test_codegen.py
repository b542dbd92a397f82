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
    builtins, when PK_PREFETCH and PK_STREAM_STORE joined, and when PK_PREFETCH_ONCE and
    PK_PREFETCH_OUTER did): the source hipcc compiles is byte for byte the same."""
    text = _preamble("hip")
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "8c4f51f435a1a00ed70bd456127e34c9ccdb470d735e402a32c5f974b5eb20d0")
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


def test_prefetch_is_a_hint_only_where_the_compiler_has_it() -> None:
    """PK_PREFETCH(p): clang's builtin in OpenCL, guarded so another compiler (or a build with
    -DPK_NO_PREFETCH: the simulator, which cannot run llvm.prefetch) gets an empty statement;
    CUDA and HIP get the empty statement."""
    from portakern.backend.oclgrind import OclgrindBackend
    from portakern.backend.opencl import OpenCLBackend

    opencl = _preamble("opencl").splitlines()
    guard = opencl.index("#if defined(__has_builtin) && !defined(PK_NO_PREFETCH)")
    assert opencl[guard + 1:guard + 7] == [
        "#if __has_builtin(__builtin_prefetch)", "#define PK_PREFETCH(p) __builtin_prefetch((p))",
        "#endif", "#endif", "#ifndef PK_PREFETCH", "#define PK_PREFETCH(p) ((void)0)"]
    # the read-once hint: a non-temporal prefetch, off with PK_NO_PREFETCH, else PK_PREFETCH
    once = opencl.index("#define PK_PREFETCH_ONCE(p) __builtin_prefetch((p), 0, 0)")
    assert opencl[once - 2] == "#if defined(__has_builtin) && !defined(PK_NO_PREFETCH)"
    assert "#define PK_PREFETCH_ONCE(p) PK_PREFETCH(p)" in opencl[once:once + 5]
    # the outer-cache hint: prefetcht2 (locality 1), off with PK_NO_PREFETCH, else ONCE
    outer = opencl.index("#define PK_PREFETCH_OUTER(p) __builtin_prefetch((p), 0, 1)")
    assert opencl[outer - 2] == "#if defined(__has_builtin) && !defined(PK_NO_PREFETCH)"
    assert "#define PK_PREFETCH_OUTER(p) PK_PREFETCH_ONCE(p)" in opencl[outer:outer + 5]
    for dialect in ("cuda", "hip"):
        text = _preamble(dialect)
        assert "#define PK_PREFETCH(p) ((void)0)" in text and "prefetch(" not in text
        assert "#define PK_PREFETCH_ONCE(p) PK_PREFETCH(p)" in text
        assert "#define PK_PREFETCH_OUTER(p) PK_PREFETCH_ONCE(p)" in text
    assert "-DPK_NO_PREFETCH" in OclgrindBackend.device_build_options
    assert "-DPK_NO_PREFETCH" not in OpenCLBackend.device_build_options


def test_stream_store_bypasses_caches_only_where_the_compiler_can() -> None:
    """PK_STREAM_STORE(v, p): clang's non-temporal store in OpenCL, guarded like the prefetch
    (a build defining PK_NO_STREAM_STORE gets the plain store); CUDA and HIP a plain store.
    Either way the same value lands at p."""
    opencl = _preamble("opencl").splitlines()
    guard = opencl.index("#if defined(__has_builtin) && !defined(PK_NO_STREAM_STORE)")
    assert opencl[guard + 1:guard + 7] == [
        "#if __has_builtin(__builtin_nontemporal_store)",
        "#define PK_STREAM_STORE(v, p) __builtin_nontemporal_store((v), (p))",
        "#endif", "#endif", "#ifndef PK_STREAM_STORE",
        "#define PK_STREAM_STORE(v, p) (*(p) = (v))"]
    for dialect in ("cuda", "hip"):
        text = _preamble(dialect)
        assert "#define PK_STREAM_STORE(v, p) (*(p) = (v))" in text
        assert "nontemporal" not in text


def test_lookup8_is_one_permute_only_where_the_target_has_avx2() -> None:
    """PK_LOOKUP8(t, i): in OpenCL, clang's AVX2 permute where the compiler has it and the
    target has AVX2 (guarded by both, and off with PK_NO_LOOKUP8), else OpenCL's shuffle(),
    which means the same; dialects without vectors do not define it (no kernel of theirs
    reaches the vector paths that use it)."""
    opencl = _preamble("opencl").splitlines()
    guard = opencl.index(
        "#if defined(__has_builtin) && !defined(PK_NO_LOOKUP8) && defined(__AVX2__)")
    assert opencl[guard + 1:guard + 7] == [
        "#if __has_builtin(__builtin_ia32_permvarsf256)",
        "#define PK_LOOKUP8(t, i) __builtin_ia32_permvarsf256((t), (i))",
        "#endif", "#endif", "#ifndef PK_LOOKUP8",
        "#define PK_LOOKUP8(t, i) shuffle(t, as_uint8(i))"]
    for dialect in ("cuda", "hip"):
        assert "PK_LOOKUP8" not in _preamble(dialect)
    from portakern.backend.oclgrind import OclgrindBackend
    from portakern.backend.opencl import OpenCLBackend

    assert "-DPK_NO_LOOKUP8" in OclgrindBackend.device_build_options  # (vexp.c: no .hi)
    assert "-DPK_NO_LOOKUP8" not in OpenCLBackend.device_build_options

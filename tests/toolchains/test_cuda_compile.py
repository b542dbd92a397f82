"""CUDA without a GPU: every rendered kernel compiles under NVRTC, errors show the numbered
source, and the cuda backend says plainly why it cannot run here.

Why this file exists: CI has no NVIDIA GPU, but NVRTC (a pip wheel) compiles CUDA C to PTX on
any Linux box. So each op x dtype x default schedule x architecture is compiled here, with the
options the cuda backend uses at run time, and a failure names exactly that case. The tests
marked ``gpu`` at the end run only where a CUDA device exists (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types

import numpy as np
import pytest

import portakern as pk
from portakern.backend import cuda as cuda_backend
from portakern.backend.cuda import normalize_arch
from portakern.core import codegen, dtypes
from portakern.core.errors import CompileError
from portakern.core.spec import schedule_family
from portakern.ops import OPS, get_op
from portakern.runtime import selection
from portakern.toolchains import nvrtc
from portakern.tools import compile_check

NVRTC_REASON = "NVRTC (cupy_backends, from pip install 'portakern[cuda]') is not importable"
BUILTIN_OPS = ("matmul", "softmax", "attention")


def _gpu_present() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


GPU = _gpu_present()
no_gpu_only = pytest.mark.skipif(GPU, reason="a CUDA GPU is present; this checks the no-GPU path")
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (run benchmarks/gpu_check.sh)")


def _nvrtc() -> None:
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason=NVRTC_REASON)


# --- every op x dtype x schedule x arch compiles ------------------------------------------
CASES = compile_check.cases(compile_check.DEFAULT_ARCHS)  # rendering only; NVRTC runs per test
# The CPU-family schedules ('cpu', 'cpu256') compile on one architecture here, the GPU ones on
# every one. A case's source is the same for every arch; the arch changes only what NVRTC
# does with arch-dependent code (the fragment lowerings and cuda_bf16.h's native paths),
# which the 'gpu' and 'mma' schedules reach on each. A CPU schedule on CUDA is a user's
# override, never a default, and its register-blocked scalar path is the slowest to compile:
# on all three archs it took ~250 of the file's ~550 s in CI. `portakern check --backend cuda
# --compile-only` still compiles every case on every arch.
ONE_ARCH = "80"  # compute_80
COMPILED = [c for c in CASES
            if schedule_family(c.schedule) != "cpu" or c.arch == ONE_ARCH]


@pytest.fixture(scope="module")
def precompiled(request: pytest.FixtureRequest) -> None:
    """Compile the selected cases once, in parallel processes (NVRTC holds the GIL); each
    parametrised test then reads its own result, so a failure still names its case. Under
    pytest-xdist each worker compiles only the cases it runs, one at a time (every worker
    collects every item, so a precompile would repeat the whole list in each)."""
    _nvrtc()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    chosen = [item.callspec.params["case"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_compiles_with_nvrtc"
              and "case" in getattr(getattr(item, "callspec", None), "params", {})]
    compile_check.compile_cases(chosen)


@pytest.mark.parametrize("case", COMPILED, ids=[c.name for c in COMPILED])
def test_compiles_with_nvrtc(case: compile_check.CompileCase, precompiled: None) -> None:
    res = compile_check.compile_case(case)
    assert res.status != "skip", res.note
    assert res.ok, f"{case.name} does not compile:\n{res.error}"
    assert res.ptx_bytes > 0


def test_cases_cover_every_op_dtype_schedule_and_arch() -> None:
    want_dtypes = set(compile_check.DEFAULT_DTYPES)
    want_archs = set(compile_check.DEFAULT_ARCHS)
    assert {c.op for c in CASES} >= set(OPS), "a registered op is missing from the check"
    for op in BUILTIN_OPS:
        mine = [c for c in CASES if c.op == op]
        scheds = set(get_op(op).schedules)
        assert scheds >= {"cpu", "gpu"}  # matmul adds "mma" (the fragment schedule)
        assert {(c.dtype, c.schedule, c.arch) for c in mine} == {
            (d, s, a) for d in want_dtypes for s in scheds for a in want_archs}
        assert all(c.source and c.error is None for c in mine)
    # every (op, dtype, schedule, problem) is compiled on some arch, every GPU one on each
    assert {(c.op, c.dtype, c.schedule, c.problem) for c in COMPILED} == {
        (c.op, c.dtype, c.schedule, c.problem) for c in CASES}
    assert ONE_ARCH in want_archs
    assert {c.name for c in CASES if schedule_family(c.schedule) != "cpu"} <= {
        c.name for c in COMPILED}
    heads = {c.problem for c in CASES if c.op == "attention"}
    for d in (40, 80, 111, 128):
        assert f"d{d}" in heads
    assert any("mask" in h for h in heads)


def test_representative_problems_are_validated_problems() -> None:
    label, prob = compile_check.representative_problems(get_op("attention"), "bfloat16")[-1]
    assert prob.dtype == "bfloat16" and prob.shapes["mask"] == (1, 1, 128, 128)
    assert prob.params["causal"] is True and "mask" in label
    (label, prob), = compile_check.representative_problems(get_op("matmul"))
    assert prob.out_shape == (2, 64, 80)
    # a spec with no `examples`, `example` or `shapes` has nothing to render (reported skipped)
    spec = get_op("softmax").replace(name="nobody_knows_me", examples=None, example=None)
    assert compile_check.representative_problems(spec) == []


# --- a broken source fails loudly, with the numbered source and the log -------------------
def _softmax_source() -> str:
    spec = get_op("softmax")
    _, prob = compile_check.representative_problems(spec, "float32")[0]
    return spec.render("cuda", prob, spec.config("gpu", None, prob))


def test_broken_source_raises_compile_error_with_numbered_source_and_log() -> None:
    _nvrtc()
    lines = [ln for ln in _softmax_source().splitlines()
             if not ln.startswith("#define PK_BARRIER()")]  # drop one dialect macro
    broken = "\n".join(lines) + "\n"
    uses = {i for i, ln in enumerate(lines, 1) if "PK_BARRIER();" in ln}
    with pytest.raises(CompileError) as got:
        nvrtc.compile_source(broken, "80")
    err = got.value
    msg = str(err)
    # NVRTC's log names a line that uses the macro (the first one compiled: some uses sit
    # in preprocessor branches this schedule leaves out)
    named = {int(n) for n in re.findall(r"portakern\.cu\((\d+)\)", err.log)}
    assert "PK_BARRIER" in err.log and named & uses, (err.log, sorted(uses))
    use = min(named & uses)
    assert "--- compiler log ---" in msg and "--- rendered source ---" in msg
    assert re.search(rf"^\s*{use} \|\s+PK_BARRIER\(\);", msg, re.M), "numbered source missing"
    assert "--gpu-architecture=compute_80" in msg and "--fmad=true" in msg
    assert err.source == broken


def test_check_fails_when_the_cuda_dialect_is_broken(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    _nvrtc()
    bad = dataclasses.replace(codegen.DIALECTS["cuda"], barrier="__syncthreadz()")
    monkeypatch.setitem(codegen.DIALECTS, "cuda", bad)
    results = compile_check.compile_all(archs=["80"], ops=["softmax"], dtypes=["float32"])
    assert results and all(r.status == "FAIL" for r in results)
    assert "__syncthreadz" in results[0].error.log
    rc = compile_check.main(argparse.Namespace(backend=["cuda"], ops="softmax",
                                               dtypes="float32", arch=["80"], out=None))
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "--- rendered source ---" in out and "__syncthreadz" in out


# --- the command --------------------------------------------------------------------------
def test_main_prints_the_table_and_writes_results(tmp_path, capsys) -> None:  # noqa: ANN001
    _nvrtc()
    out_file = tmp_path / "cc.json"
    rc = compile_check.main(argparse.Namespace(backend=["cuda:0"], ops="softmax,matmul",
                                               dtypes="float16", arch=["compute_90", "sm_70"],
                                               out=str(out_file)))
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "compute_90" in text and "compute_70" in text
    assert re.search(r"^softmax\s+float16\s+gpu\s+\S+\s+ok\s+ok$", text, re.M)
    import json

    data = json.loads(out_file.read_text())
    assert {r["status"] for r in data["results"]} == {"ok"}
    schedules = len(get_op("softmax").schedules) + len(get_op("matmul").schedules)
    assert len(data["results"]) == schedules * 2  # (op, schedule) pairs x archs


def test_cli_routes_compile_only(capsys) -> None:  # noqa: ANN001
    _nvrtc()
    from portakern.tools import cli

    rc = cli.main(["check", "--backend", "cuda", "--compile-only", "--ops", "softmax",
                   "--dtypes", "bfloat16", "--arch", "80"])
    assert rc == 0
    assert "compute_80" in capsys.readouterr().out


def test_main_refuses_other_backends(capsys) -> None:  # noqa: ANN001
    ns = argparse.Namespace(backend=["opencl"], ops=None, dtypes=None, arch=None, out=None)
    assert compile_check.main(ns) == 2
    out = capsys.readouterr().out
    assert "portakern check --backend opencl" in out and "cuda, hip" in out  # hip: hipcc


def test_arch_spellings() -> None:
    for text in ("80", "compute_80", "sm_80", "8.0", 80):
        assert normalize_arch(text) == "80"
    with pytest.raises(pk.InvalidArgumentError, match="compute capability"):
        normalize_arch("ampere")


def test_unsupported_arch_is_refused_with_the_supported_list() -> None:
    _nvrtc()
    with pytest.raises(pk.InvalidArgumentError, match="supports"):
        compile_check.compile_all(archs=["10"], ops=["softmax"])


def test_main_lists_an_arch_this_nvrtc_cannot_target(capsys) -> None:  # noqa: ANN001
    _nvrtc()
    rc = compile_check.main(argparse.Namespace(backend=["cuda"], ops="softmax",
                                               dtypes="float32", arch=["10", "80"], out=None))
    out = capsys.readouterr().out
    assert rc == 1, out  # a required architecture refused fails the check
    assert "target compute_10 not accepted (REQUIRED)" in out and "supports" in out
    assert re.search(r"^softmax\s+float32\s+gpu\s+\S+\s+ok$", out, re.M)  # 80 still compiled


def test_the_compile_only_target_compiles_through_its_hook() -> None:
    _nvrtc()
    from portakern import toolchains

    target = toolchains.get("cuda")
    src = _softmax_source()
    got = target.compile(src, "80", None, "softmax" + target.suffix)
    assert got.ok and got.object_bytes > 0 and got.error(src) is None
    bad = target.compile(src + "\nthis is not C\n", "80", None, "softmax" + target.suffix)
    assert not bad.ok and isinstance(bad.error(src), CompileError)
    assert "compute_80" in bad.device


# --- numerics are stated in the options ---------------------------------------------------
def test_compile_options_state_the_numerics() -> None:
    opts = cuda_backend.compile_options()
    assert "--fmad=true" in opts and "--ftz=false" in opts
    assert not set(opts) & set(cuda_backend.FORBIDDEN_OPTIONS)
    assert any(o.startswith("--std=c++") for o in opts)


def test_cuda_headers_are_found() -> None:
    _nvrtc()
    inc = cuda_backend.find_cuda_include_dir()
    assert inc is not None, "no cuda_fp16.h: pip install nvidia-cuda-runtime-cu12"
    assert f"-I{inc}" in cuda_backend.compile_options()


# --- no GPU here: unavailable, with the reason and the fix --------------------------------
@no_gpu_only
def test_cuda_backend_is_unavailable_with_a_reason() -> None:
    info = pk.backends()["cuda"]
    assert info["available"] is False
    assert info["reason"] and info["fix"]
    if "cupy" in info["versions"]:  # cupy installed: the missing piece is the driver/device
        assert re.search(r"no CUDA (driver|device)|driver cannot be used", info["reason"])
        assert "nvrtc" in info["versions"]
    else:
        assert "portakern[cuda]" in info["fix"]


@no_gpu_only
def test_matmul_on_cuda_raises_backend_unavailable() -> None:
    a = np.ones((4, 3), np.float32)
    with pytest.raises(pk.BackendUnavailable) as got:
        pk.matmul(a, a.T, backend="cuda")
    assert pk.backends()["cuda"]["reason"] in str(got.value)
    assert "Fix:" in str(got.value)


def _fake_cupy(count: object, driver: int = 12040, hip: bool = False) -> types.SimpleNamespace:
    def device_count() -> int:
        if isinstance(count, Exception):
            raise count
        return int(count)  # type: ignore[call-overload]

    props = {"name": b"Fake H200", "major": 9, "minor": 0, "totalGlobalMem": 141 << 30,
             "maxThreadsPerBlock": 1024, "sharedMemPerBlock": 48 << 10,
             "sharedMemPerBlockOptin": 227 << 10, "multiProcessorCount": 132,
             "maxThreadsDim": (1024, 1024, 64), "maxGridSize": (2**31 - 1, 65535, 65535)}
    rt = types.SimpleNamespace(runtimeGetVersion=lambda: 12090, driverGetVersion=lambda: driver,
                               getDeviceCount=device_count, is_hip=hip,
                               getDeviceProperties=lambda i: props)
    return types.SimpleNamespace(__version__="14.2.0", cuda=types.SimpleNamespace(runtime=rt))


def test_probe_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_backend, "cp", None)
    monkeypatch.setattr(cuda_backend, "_IMPORT_ERROR", ImportError("No module named 'cupy'"))
    av = cuda_backend.CudaBackend._probe()
    assert not av.available and "cupy" in av.reason and av.fix == "pip install 'portakern[cuda]'"


def test_probe_without_driver_device_or_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_backend, "cp", _fake_cupy(RuntimeError("insufficient"), driver=0))
    av = cuda_backend.CudaBackend._probe()
    assert not av.available and "no CUDA driver" in av.reason and av.fix
    assert av.versions["cuda_runtime"] == "12.9" and "cuda_driver" not in av.versions
    monkeypatch.setattr(cuda_backend, "cp", _fake_cupy(0))
    av = cuda_backend.CudaBackend._probe()
    assert not av.available and "no CUDA device" in av.reason
    monkeypatch.setattr(cuda_backend, "cp", _fake_cupy(1, hip=True))
    av = cuda_backend.CudaBackend._probe()
    assert not av.available and "ROCm" in av.reason and "opencl" in av.fix


def test_probe_records_device_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_backend, "cp", _fake_cupy(2))
    av = cuda_backend.CudaBackend._probe()
    assert av.available and len(av.devices) == 2
    d = av.devices[1]
    assert (d.index, d.name, d.kind, d.vendor) == (1, "Fake H200", "gpu", "NVIDIA")
    assert d.extra["compute_capability"] == "9.0" and d.extra["memory_bytes"] == 141 << 30
    assert d.max_work_group_size == 1024 and d.local_mem_bytes == 48 << 10
    assert d.extra["shared_mem_per_block_optin"] == 227 << 10 and d.compute_units == 132
    assert av.versions["cuda_driver"] == "12.4" and av.versions["cupy"] == "14.2.0"


def test_module_key_separates_options_and_versions() -> None:
    k = cuda_backend.module_key("src", ("--fmad=true",), "9.0", "12.9", "14.2.0")
    assert k != cuda_backend.module_key("src", ("--fmad=false",), "9.0", "12.9", "14.2.0")
    assert k != cuda_backend.module_key("src", ("--fmad=true",), "8.0", "12.9", "14.2.0")
    assert k != cuda_backend.module_key("src", ("--fmad=true",), "9.0", "12.8", "14.2.0")
    assert k == cuda_backend.module_key("src", ("--fmad=true",), "9.0", "12.9", "14.2.0")


# --- `portakern show attention --backend cuda` prints CUDA C -------------------------------
def _assert_cuda_c(text: str) -> None:
    assert "#include <cuda_fp16.h>" in text
    assert 'extern "C" __global__' in text and "__syncthreads()" in text
    assert "__shared__" in text and "void attention(" in text
    assert "__kernel" not in text and "barrier(CLK_LOCAL_MEM_FENCE)" not in text


def test_show_attention_for_cuda_prints_cuda_c(capsys) -> None:  # noqa: ANN001
    pytest.importorskip("portakern.tools.show", reason="tools/show.py (`portakern show`) is not "
                        "in this tree yet; test_attention_renders_as_cuda_c covers the renderer")
    from portakern.tools import cli

    assert cli.main(["show", "attention", "--backend", "cuda"]) == 0
    _assert_cuda_c(capsys.readouterr().out)


def test_attention_renders_as_cuda_c() -> None:
    spec = get_op("attention")
    _, prob = compile_check.representative_problems(spec)[0]
    _assert_cuda_c(spec.render("cuda", prob, spec.config("gpu", None, prob)))


# --- on a GPU (benchmarks/gpu_check.sh) ---------------------------------------------------
@gpu_only
@pytest.mark.gpu
def test_gpu_cupy_in_cupy_out_without_host_copies() -> None:
    import cupy

    be = selection.resolve("cuda")
    a = cupy.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    b = cupy.asarray(np.ones((4, 5), np.float32))
    be.transfers.reset()
    c = pk.matmul(a, b, backend=be)
    assert isinstance(c, cupy.ndarray) and c.dtype == np.float32
    assert be.transfers.snapshot()["h2d"] == 0 and be.transfers.snapshot()["d2h"] == 0
    np.testing.assert_array_equal(cupy.asnumpy(c), np.arange(12.0).reshape(3, 4) @ np.ones((4, 5)))


@gpu_only
@pytest.mark.gpu
def test_gpu_numpy_in_numpy_out_counted_and_bf16_kept() -> None:
    be = selection.resolve("cuda")
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16).astype(dtypes.bfloat16)
    be.transfers.reset()
    y = pk.softmax(x, backend=be)
    assert isinstance(y, np.ndarray) and y.dtype == dtypes.bfloat16
    snap = be.transfers.snapshot()
    assert snap["h2d"] == 1 and snap["d2h"] == 1
    ref = pk.softmax(x, backend="numpy")
    assert np.max(np.abs(y.astype(np.float32) - ref.astype(np.float32))) <= 2 ** -7


@gpu_only
@pytest.mark.gpu
def test_gpu_non_contiguous_view_is_refused_by_name() -> None:
    import cupy

    x = cupy.ones((8, 8), np.float32)[:, ::2]
    with pytest.raises(pk.InvalidArgumentError, match="'x'.*non-contiguous"):
        pk.softmax(x, backend="cuda")


@gpu_only
@pytest.mark.gpu
def test_gpu_backend_compile_error_carries_source() -> None:
    be = selection.resolve("cuda")
    with pytest.raises(CompileError, match=r"rendered source") as got:
        be.compile('extern "C" __global__ void k() { undefined_thing(); }\n', ("k",))
    assert "undefined_thing" in got.value.log


@gpu_only
@pytest.mark.gpu
def test_gpu_device_selector_and_info() -> None:
    av = pk.backends()["cuda"]
    assert av["available"] and av["devices"][0]["kind"] == "gpu"
    assert "compute_capability" in av["devices"][0]["extra"]
    with pytest.raises(pk.BackendUnavailable, match="does not exist"):
        selection.get(f"cuda:{len(av['devices'])}")


def test_static_shared_memory_over_48k_is_a_compile_error() -> None:
    _nvrtc()
    src = ('extern "C" __global__ void k(float* p) {\n'
           '    __shared__ double big[8000];\n'  # 64000 bytes: ptxas would refuse it
           '    big[threadIdx.x] = p[threadIdx.x];\n'
           '    __syncthreads();\n'
           '    p[threadIdx.x] = (float)big[threadIdx.x + 1];\n'
           '}\n')
    with pytest.raises(CompileError, match="too much shared memory") as got:
        nvrtc.compile_source(src, "90")
    assert "64000 bytes" in got.value.log
    assert re.search(r"^\s*2 \|\s+__shared__ double big", str(got.value), re.M)
    ptx = ".shared .align 8 .b8 a[16384];\n.shared .align 4 .f32 s;\n.extern .shared .b8 d[];\n"
    assert nvrtc.static_shared_bytes(ptx) == 16384 + 4

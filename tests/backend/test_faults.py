"""Faults, each injected: what portakern raises or records, and that everything else goes on.

* a kernel that does not compile: CompileError with the device, the options, the compiler's
  log and the rendered source numbered so the log's line numbers point into it — for every
  C-kernel target, and for CUDA through NVRTC where CuPy is importable (no GPU needed);
  nothing broken is cached, and the same backend keeps compiling good kernels;
* a device allocation that fails: DeviceMemoryError (a MemoryError) naming the requested and
  available sizes — injected into pyopencl's upload, output allocation and launch, injected
  into jax's device_put, and one real refusal: an output larger than the OpenCL device's
  max_mem_alloc_size (nothing is allocated on the host for it);
* a backend whose import raises, and one whose probe raises: reported unavailable with the
  exception, refused by name, while every other backend keeps working;
* Ctrl-C during ``portakern bench``: in process (KeyboardInterrupt injected into the second
  case's measurement) and as a real SIGINT to a ``portakern bench`` child process — the result
  file exists, says ``interrupted``, and holds the case measured before.

The on-disk cache faults (truncated or corrupted files, read-only directory, concurrent
writers) are tested in tests/core/test_cache.py and tests/tools/test_tune.py.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.backend import registry
from portakern.backend.base import (
    ArrayBackend,
    Backend,
    DeviceInfo,
    KernelBackend,
    TransferCounter,
)
from portakern.core import codegen
from portakern.runtime import execute, selection

f32 = np.float32
A = np.arange(20, dtype=f32).reshape(4, 5)
B = np.arange(15, dtype=f32).reshape(5, 3)
REPO = Path(__file__).resolve().parents[2]


def _available(name: str) -> bool:
    return bool(pk.backends()[name]["available"])


def _broken_spec(name: str, body: str = "  int fine = 1;\n  oops;\n") -> pk.KernelSpec:
    """softmax with a kernel that cannot compile (the error on a known line)."""
    src = "PK_KERNEL void softmax() {\n" + body + "}\n"
    return pk.ops.get_op("softmax").replace(name=name, source=src)


def _line_of(log: str) -> int | None:
    """The first source line number a compiler log points at (clang ':40:3:', NVRTC '(31):')."""
    m = re.search(r":(\d+):\d+: *(?:fatal )?error", log) or re.search(r"\((\d+)\): *error", log)
    return int(m.group(1)) if m else None


def _check_compile_error(exc: pk.CompileError, needle: str = "oops") -> None:
    msg = str(exc)
    assert isinstance(exc, RuntimeError) and isinstance(exc, pk.PortakernError)
    for part in ("device:", "options:", "--- compiler log ---", "--- rendered source ---"):
        assert part in msg, f"CompileError lacks {part!r}: {msg[:400]}"
    assert needle in exc.log, f"the compiler log does not mention {needle!r}: {exc.log}"
    numbered = msg.split("--- rendered source ---", 1)[1].splitlines()
    line = _line_of(exc.log)
    if line is not None:  # the log's line number points at the offending line of the listing
        hit = [x for x in numbered if re.match(rf"^\s*{line} \| ", x)]
        assert hit and needle in hit[0], f"log line {line} is not {needle!r}: {hit}"


# --- compile errors -----------------------------------------------------------------------
def test_compile_error_on_every_kernel_target(kernel_target: str) -> None:
    be = selection.get(kernel_target)
    assert isinstance(be, KernelBackend)
    name = f"softmax_broken_{kernel_target.replace(':', '_')}"
    pk.register_op(_broken_spec(name), replace=True)
    try:
        for _ in range(2):  # a failed build is not cached: the second call fails the same way
            with pytest.raises(pk.CompileError) as info:
                pk.call(name, A, backend=be)
            _check_compile_error(info.value)
        assert be.describe() in str(info.value)
    finally:
        pk.unregister_op(name)
    good = pk.softmax(A, backend=be)  # the backend is unharmed
    np.testing.assert_allclose(good, pk.softmax(A, backend="numpy"), rtol=1e-5)


@contextlib.contextmanager
def _cuda_without_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A CudaBackend whose compile() runs real NVRTC for compute_80 on a machine without a GPU.

    CuPy asks the current device for its architecture; with no driver that fails, so the
    (private) architecture hook is pinned to compute_80/PTX. Loading the module needs a GPU,
    so only the compile step is exercised — which is where CompileError is made."""
    cuda = importlib.import_module("portakern.backend.cuda")
    if cuda.cp is None:
        pytest.skip(f"cupy is not importable: {registry.availability('cuda').reason}")
    try:
        cuda.nvrtc_version()
    except Exception as exc:
        pytest.skip(f"NVRTC cannot load here: {exc}")
    compiler = cuda.cp.cuda.compiler
    if not hasattr(compiler, "_get_arch_for_options_for_nvrtc"):
        pytest.skip("this CuPy has no _get_arch_for_options_for_nvrtc hook to pin the arch")
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                        lambda arch=None: ("-arch=compute_80", "ptx"))
    monkeypatch.setenv("PORTAKERN_CUDA_CACHE", "off")
    be = object.__new__(cuda.CudaBackend)
    be.selector, be.transfers, be._lock = "0", TransferCounter(), threading.RLock()
    be.device = DeviceInfo(0, "compile-only stand-in", "gpu",
                           extra={"compute_capability": "8.0"})
    be._cp_device = contextlib.nullcontext()
    be._options = cuda.compile_options()
    be._modules, be._kernels = {}, {}
    yield be


def test_cuda_compile_error_from_nvrtc(monkeypatch: pytest.MonkeyPatch) -> None:
    with _cuda_without_gpu(monkeypatch) as be:
        src = codegen.render("PK_KERNEL void k(PK_GLOBAL float* x) {\n  x[0] = 1.0f;\n"
                             "  oops;\n}\n", "cuda", slots={}, defines={})
        with pytest.raises(pk.CompileError) as info:
            be.compile(src, ("k",))
        _check_compile_error(info.value)
        assert "NVRTC" in str(info.value) and "compute capability 8.0" in str(info.value)
        assert "--fmad=true" in info.value.options  # the options it was compiled with
        assert not be._modules, "a failed NVRTC build must not be cached"


# --- device allocation failures ------------------------------------------------------------
def _opencl() -> Backend:
    if not _available("opencl"):
        pytest.skip("opencl unavailable: " + pk.backends()["opencl"]["reason"])
    return selection.get("opencl:0")


def _cl_memory_error(routine: str) -> Exception:
    """A pyopencl MemoryError as the driver raises it (MEM_OBJECT_ALLOCATION_FAILURE)."""
    import pyopencl as cl

    record = getattr(cl._cl, "_ErrorRecord", None)
    code = int(cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE)
    args = (record(routine, code, "injected by test_faults.py"),) if record else (routine,)
    return cl.MemoryError(*args)


def _check_oom(exc: BaseException, nbytes: int, be: Backend) -> None:
    assert isinstance(exc, pk.DeviceMemoryError) and isinstance(exc, MemoryError)
    msg = str(exc)
    assert f"{nbytes} bytes" in msg, f"requested size {nbytes} not named: {msg}"
    assert be.describe() in msg and "Fix:" in msg
    dev = getattr(be, "cl_device", None)
    if dev is not None:  # what the device offers
        assert str(dev.global_mem_size) in msg and str(dev.max_mem_alloc_size) in msg


def test_opencl_upload_allocation_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    be = _opencl()
    import pyopencl.array as cla

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise _cl_memory_error("clCreateBuffer")

    monkeypatch.setattr(cla, "to_device", fail)
    with pytest.raises(pk.DeviceMemoryError) as info:
        pk.matmul(A, B, backend=be)
    _check_oom(info.value, A.nbytes, be)
    monkeypatch.undo()
    np.testing.assert_allclose(pk.matmul(A, B, backend=be), A @ B)  # and then it works again


@pytest.mark.parametrize("which", ["empty", "zeros"])
def test_opencl_output_allocation_failure(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    """``empty`` backs every output; ``zeros`` the empty-result path (here K = 0).

    The inputs are uploaded first, then every device allocation fails: the output allocation
    must say so, on the first call of a shape (pyopencl.array.empty) and on later calls
    (the backend's fast constructor) alike."""
    be = _opencl()

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise _cl_memory_error("clCreateBuffer")

    a, b = (A, B) if which == "empty" else (A[:, :0], B[:0])
    da, db = be.to_native(np.ascontiguousarray(a)), be.to_native(np.ascontiguousarray(b))
    fresh = type(be)("0")  # no output of this shape made yet: the first-call path
    fa, fb = fresh.to_native(np.ascontiguousarray(a)), fresh.to_native(np.ascontiguousarray(b))
    pk.matmul(da, db, backend=be)  # this shape's output made once: the fast path next

    class FailingPool:  # every device allocation of a backend with a pool comes from it
        allocate = staticmethod(fail)

        def free_held(self) -> None:
            pass

    for backend in (fresh, be):
        monkeypatch.setattr(backend, "memory_pool", FailingPool())
    for backend, x, y in ((fresh, fa, fb), (be, da, db)):
        with pytest.raises(pk.DeviceMemoryError) as info:
            pk.matmul(x, y, backend=backend)
        _check_oom(info.value, 4 * 3 * 4, backend)
        assert "(4, 3)" in str(info.value)


def test_opencl_outputs_from_the_prototype_are_independent_arrays() -> None:
    """After the first output of a shape, OpenCLBackend.empty re-wraps a fresh buffer in the
    prototype's layout (``_new_with_changes``): each array must still own its buffer and
    event list, and behave like one pyopencl.array.empty made (shape, strides, dtype, flags,
    reads, pyopencl arithmetic)."""
    import pyopencl.array as cla

    be = _opencl()
    shape = (5, 7)
    ref = cla.empty(be.queue, shape, np.float32)  # type: ignore[attr-defined]
    first = be.empty(shape, "float32")  # type: ignore[attr-defined]
    a, b = be.empty(shape, "float32"), be.empty(shape, "float32")  # type: ignore[attr-defined]
    assert be.cache_info()["output_templates"]["size"]  # the prototype path ran
    for x in (first, a, b):
        assert (x.shape, x.strides, x.dtype, x.size, x.nbytes, x.offset) == (
            ref.shape, ref.strides, ref.dtype, ref.size, ref.nbytes, ref.offset)
        assert x.flags.c_contiguous and x.context == be.ctx  # type: ignore[attr-defined]
    assert a.base_data is not b.base_data and a.base_data.int_ptr != b.base_data.int_ptr
    import pyopencl as cl

    a.add_event(cl.enqueue_marker(be.queue))  # type: ignore[attr-defined]
    assert len(a.events) == 1 and b.events == [] and first.events == []
    ha = np.arange(35, dtype=np.float32).reshape(shape)
    a.set(ha)
    b.set(-ha)
    np.testing.assert_array_equal((a + b).get(), np.zeros(shape, np.float32))
    np.testing.assert_array_equal(a.get(), ha)


def _arrays_with_extra(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """Give every new pyopencl Array one more attribute, ``extra = make()``: what a pyopencl
    release adding an attribute to Array would look like."""
    import pyopencl.array as cla

    real = cla.Array.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        self.extra = make()

    monkeypatch.setattr(cla.Array, "__init__", init)


@pytest.mark.parametrize("extra", [list, dict, lambda: 3])
def test_opencl_outputs_from_the_prototype_go_through_pyopencls_constructor(
        monkeypatch: pytest.MonkeyPatch, extra: Any) -> None:
    """Outputs after the first of a shape are made by pyopencl's own constructor, so an
    attribute a pyopencl release adds in Array.__init__ is each array's own (a mutable one
    is never shared), and every array owns its buffer."""
    be = type(_opencl())("0")  # no prototype made yet
    _arrays_with_extra(monkeypatch, extra)
    x = be.empty((3, 4), "float32")  # type: ignore[attr-defined]
    y = be.empty((3, 4), "float32")  # type: ignore[attr-defined]  # from the prototype
    assert be.cache_info()["output_templates"]["size"] == 1
    assert x.extra == y.extra
    if isinstance(x.extra, (list, dict)):
        assert x.extra is not y.extra
    assert x.base_data is not y.base_data and x.shape == y.shape == (3, 4)
    got = pk.softmax(be.to_native(np.ones((3, 4), np.float32)), backend=be)
    np.testing.assert_allclose(got.get(), np.full((3, 4), 0.25, np.float32), rtol=1e-6)


def test_opencl_pool_frees_what_it_holds_before_giving_up(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A pooled allocation that fails is retried once after the pool's idle blocks are freed
    (memory the program no longer uses must not cause an out-of-memory error)."""
    be = _opencl()
    real = be.memory_pool  # type: ignore[attr-defined]
    if real is None:
        pytest.skip("PORTAKERN_OPENCL_POOL=0: no memory pool")
    calls: list[str] = []

    class FlakyPool:
        def allocate(self, nbytes: int) -> Any:
            calls.append("allocate")
            if calls.count("allocate") == 1:
                raise _cl_memory_error("clCreateBuffer")
            return real.allocate(nbytes)

        def free_held(self) -> None:
            calls.append("free_held")
            real.free_held()

    monkeypatch.setattr(be, "memory_pool", FlakyPool())
    np.testing.assert_allclose(pk.matmul(A, B, backend=be), A @ B, rtol=1e-5)
    assert calls[:3] == ["allocate", "free_held", "allocate"], calls


def test_opencl_allocation_failure_at_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drivers may allocate lazily and fail at the first launch that touches a buffer."""
    be = _opencl()
    import pyopencl as cl

    unpacked = {"PACK_B": 0}  # one launch: its buffers are exactly a, b and the output
    pk.matmul(A, B, backend=be, config=unpacked)  # compiled and planned: next call launches

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise _cl_memory_error("clEnqueueNDRangeKernel")

    monkeypatch.setattr(cl, "enqueue_nd_range_kernel", fail)
    with pytest.raises(pk.DeviceMemoryError) as info:
        pk.matmul(A, B, backend=be, config=unpacked)
    msg = str(info.value)
    # pooled blocks may be rounded up: the message names at least the bytes of a, b and out
    got = int(msg.split("cannot allocate ")[1].split(" bytes")[0])
    assert "buffers of kernel 'matmul'" in msg and got >= A.nbytes + B.nbytes + 4 * 3 * 4, msg
    monkeypatch.undo()
    np.testing.assert_allclose(pk.matmul(A, B, backend=be), A @ B, rtol=1e-5)


def test_opencl_real_refusal_of_an_output_over_max_alloc() -> None:
    """No injection: ask the device for one output buffer larger than it allows. Cheap: the
    inputs are (m, 1) and (1, n), a few hundred kilobytes, and the driver refuses the output
    (CL_INVALID_BUFFER_SIZE) before allocating anything."""
    be = _opencl()
    dev = be.cl_device  # type: ignore[attr-defined]
    dtype = np.float64 if "float64" in be.supported_dtypes() else f32
    elements = dev.max_mem_alloc_size // np.dtype(dtype).itemsize + 1
    if elements > 2**31 - 1:
        pytest.skip(f"max_mem_alloc_size {dev.max_mem_alloc_size} is more than a 32-bit "
                    "indexed output can ask for")
    m = 1 << 15
    n = -(-elements // m)
    a, b = np.ones((m, 1), dtype), np.ones((1, n), dtype)
    with pytest.raises(pk.DeviceMemoryError) as info:
        pk.matmul(a, b, backend=be)
    _check_oom(info.value, m * n * np.dtype(dtype).itemsize, be)
    np.testing.assert_allclose(pk.matmul(A, B, backend=be), A @ B)  # still usable


def test_jax_allocation_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _available("jax"):
        pytest.skip("jax unavailable: " + pk.backends()["jax"]["reason"])
    jaxb = importlib.import_module("portakern.backend.jax")
    from jax.errors import JaxRuntimeError

    be = selection.get("jax:cpu")

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                              f"{A.nbytes} bytes (injected by tests/backend/test_faults.py)")

    monkeypatch.setattr(jaxb.jax, "device_put", fail)
    with pytest.raises(pk.DeviceMemoryError) as info:
        pk.matmul(A, B, backend=be)
    assert f"{A.nbytes} bytes" in str(info.value) and "Fix:" in str(info.value)
    monkeypatch.undo()
    np.testing.assert_allclose(pk.matmul(A, B, backend=be), A @ B)


# --- a backend whose import (or probe) raises ------------------------------------------------
@pytest.fixture
def broken_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Register 'brokenimport' (its module raises on import) and 'brokenprobe' (its probe
    raises); remove both, and every trace of them, afterwards."""
    mod = "portakern_test_broken_backend"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent("""\
        raise ImportError("simulated: libfakedriver.so.1 cannot be opened")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))

    class ProbeRaises(ArrayBackend):
        name = "brokenprobe"
        install_hint = "reinstall the fake driver"

        @classmethod
        def _probe(cls) -> Any:
            raise RuntimeError("simulated: driver crashed while listing devices")

        def _open(self, selector: str | None) -> Any:
            raise AssertionError("never opened: its probe fails")

        is_native = to_native = to_numpy = zeros = execute = _open  # type: ignore[assignment]  # never reached

    registry.register_backend("brokenimport", f"{mod}:Backend")
    registry.register_backend("brokenprobe", ProbeRaises)
    try:
        yield ("brokenimport", "brokenprobe")
    finally:
        for name in ("brokenimport", "brokenprobe"):
            assert registry.unregister_backend(name)
            assert name not in registry.names()
            with pytest.raises(pk.UnknownBackendError):
                selection.get(name)
        sys.modules.pop(mod, None)


@pytest.mark.per_target
def test_a_backend_whose_import_raises_is_reported_and_the_rest_work(
        broken_backends: tuple[str, str]) -> None:
    from conftest import TARGETS

    info = pk.backends()
    imp = info["brokenimport"]
    assert imp["available"] is False
    assert "ImportError" in imp["reason"] and "libfakedriver" in imp["reason"] and imp["fix"]
    probe = info["brokenprobe"]
    assert probe["available"] is False
    assert "RuntimeError" in probe["reason"] and "listing devices" in probe["reason"]
    assert probe["fix"] == "reinstall the fake driver"
    for name in broken_backends:
        with pytest.raises(pk.BackendUnavailable) as err:
            pk.matmul(A, B, backend=name)
        assert "cannot run here" in str(err.value) and "Fix:" in str(err.value)
    for t in TARGETS:  # everything else is untouched
        np.testing.assert_allclose(pk.matmul(A, B, backend=t), A @ B, rtol=1e-3)
    pk.explain()  # automatic selection skips the broken ones
    assert selection.automatic()[0].split(":")[0] not in broken_backends


def test_broken_backends_leave_no_trace_after_cleanup() -> None:
    assert "brokenimport" not in registry.names() and "brokenprobe" not in registry.names()


# --- Ctrl-C during `portakern bench` ----------------------------------------------------------
def _bench_target() -> str:
    for name, sel in (("opencl", "opencl:0"), ("jax", "jax:cpu")):
        if _available(name):
            return sel
    pytest.skip("no benchmark target (opencl or jax) is available")


def test_bench_interrupted_in_process_keeps_the_measured_case(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real measurements; KeyboardInterrupt raised inside the SECOND case's measurement."""
    from portakern.tools.bench import runner
    from portakern.tools.bench.timing import TimingConfig

    real = runner.measure_ours
    calls = {"n": 0}

    def measure_then_interrupt(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "measure_ours", measure_then_interrupt)
    out = tmp_path / "bench.json"
    cfg = runner.BenchConfig(ops=("matmul",), targets=(_bench_target(),), limit=3,
                             dtypes=("float32",), out=str(out), probes=False, peers=("cublas",),
                             unfused=False, progress=open(os.devnull, "w"),  # noqa: SIM115
                             timing=TimingConfig(min_time=0.01, min_reps=2, budget_s=10))
    try:
        res = runner.run_bench(cfg)
    finally:
        cfg.progress.close()
    assert res["interrupted"] is True and res["complete"] is False
    on_disk = json.loads(out.read_text())
    assert on_disk["interrupted"] is True
    first, second = on_disk["cases"][0], on_disk["cases"][1]
    assert first["ours"]["status"] == "ok" and first["ours"]["median_s"] > 0
    assert second.get("interrupted") is True and second["ours"]["status"] == "interrupted"
    assert len(on_disk["cases"]) == 2  # the third case never started


def test_bench_survives_a_real_sigint(tmp_path: Path) -> None:
    """`portakern bench` in a child process, SIGINT while the second case is measured.

    Should the interrupt land in a gc callback anyway (see the next test), a second SIGINT is
    sent, the file is checked all the same, and the lost interrupt fails the test."""
    target = _bench_target()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-c", "import sys; from portakern.tools.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "bench", "--ops", "matmul", "--dtypes", "float32",
           "--backends", target, "--limit", "3", "--peers", "cublas", "--no-probes",
           "--no-plots", "--no-unfused", "--min-time", "1.5", "--min-reps", "2",
           # no rep cap: each case really measures 1.5 s, so the SIGINT 0.5 s into the second
           # case lands there however fast the kernel is (a 1.5 ms matmul hit the default cap
           # of reps in 0.3 s, and the signal then fell in the third case)
           "--max-reps", "1000000",
           "--out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lost = False
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads(out.read_text())["cases"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        time.sleep(0.5)  # into the second case's measurement (see the gc test below)
        assert proc.poll() is None, "bench finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            lost = True
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 130 and not lost:
        lost = "Exception ignored" in output and "KeyboardInterrupt" in output
    res = json.loads(out.read_text())
    measured = [c for c in res["cases"] if c["ours"]["status"] == "ok"]
    assert measured and measured[0]["ours"]["median_s"] > 0, res["cases"]
    if lost:
        pytest.fail("the first SIGINT was swallowed (KeyboardInterrupt raised inside a gc "
                    "callback or __del__) and the runner's latch (bench/interrupt.py) did not "
                    "raise it again at the next measurement boundary")
    assert proc.returncode == 130, f"exit {proc.returncode}:\n{output[-3000:]}"
    assert res["interrupted"] is True and res["complete"] is False
    assert len(res["cases"]) < 3
    assert "interrupted" in output


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_during_garbage_collection_is_not_lost(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from portakern.tools.bench import runner

    class Stub:
        name, label = "stub", "stub:0"
        device = DeviceInfo(0, "stub device", "accelerator")

        def describe(self) -> str:
            return "stub:0"

    done: list[str] = []

    def fake_case(be: Any, case: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        done.append(case.id)
        return {"id": case.id, "op": case.op, "ours": {"status": "ok", "median_s": 1e-3},
                "peers": {}, "cost": {"flops": None, "bytes": None}}

    def ctrl_c_in_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and len(done) == 1 and not fired:
            fired.append(True)
            # what a Ctrl-C landing here does: the installed SIGINT handler runs in this
            # frame; its KeyboardInterrupt is swallowed by gc ("Exception ignored")
            handler = signal.getsignal(signal.SIGINT)
            assert callable(handler)
            handler(signal.SIGINT, None)

    fired: list[bool] = []
    monkeypatch.setattr(runner, "open_targets", lambda wanted: ([Stub()], {}))
    monkeypatch.setattr(runner, "run_case", fake_case)
    gc.callbacks.append(ctrl_c_in_gc)
    try:
        cfg = runner.BenchConfig(ops=("matmul",), out=str(tmp_path / "r.json"), probes=False,
                                 peers=("cublas",), progress=open(os.devnull, "w"))  # noqa: SIM115
        res = runner.run_bench(cfg)
        cfg.progress.close()
    finally:
        gc.callbacks.remove(ctrl_c_in_gc)
    assert fired, "the runner did not collect garbage after the first case"
    assert res["interrupted"] is True and len(res["cases"]) == 1


# --- issue 19: device arrays checked against their buffers; out= aliasing; memory budget -----
def _cl_array(be: Backend, shape: tuple[int, ...], nbytes: int, flags: str = "READ_WRITE") -> Any:
    """A pyopencl Array of ``shape`` float32 on a buffer of ``nbytes`` (maybe too small)."""
    import pyopencl as cl
    import pyopencl.array as cla

    buf = cl.Buffer(be.ctx, getattr(cl.mem_flags, flags), nbytes)  # type: ignore[attr-defined]
    return cla.Array(be.queue, shape, f32, data=buf)  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["input", "out"])
def test_opencl_short_buffer_is_refused_before_any_launch(where: str) -> None:
    """A pyopencl Array whose buffer is smaller than its shape says (the issue's segfault:
    64 bytes behind a (2048, 2048) float32 array) is refused by name, never read or written
    past; the backend stays usable."""
    be = _opencl()
    short = _cl_array(be, (2048, 2048), 64)
    good = pk.to_backend(np.ones((2048, 2048), f32), be)
    args, kw = ((short,), {}) if where == "input" else ((good,), {"out": short})
    for _ in range(2):  # cold, and after the call was planned
        with pytest.raises(pk.InvalidArgumentError) as info:
            pk.call("softmax", *args, backend=be, **kw)
        msg = str(info.value)
        assert "16777216 bytes" in msg and "holds 64" in msg, msg
    pk.softmax(good, backend=be)  # plan it, then the hot paths must check the buffer too
    with pytest.raises(pk.InvalidArgumentError):
        pk.call("softmax", *args, backend=be, **kw)
    np.testing.assert_allclose(pk.matmul(A, B, backend=be), A @ B)


def test_opencl_read_only_out_is_refused() -> None:
    be = _opencl()
    x = pk.to_backend(np.ones((8, 8), f32), be)
    ro = _cl_array(be, (8, 8), 8 * 8 * 4, "READ_ONLY")
    with pytest.raises(pk.InvalidArgumentError, match="READ_ONLY"):
        pk.call("softmax", x, backend=be, out=ro)


def _alias_cases(be: Backend) -> list[tuple[str, tuple, Any]]:
    rng = np.random.default_rng(0)
    a = pk.to_backend(rng.random((16, 16), f32), be)
    b = pk.to_backend(rng.random((16, 16), f32), be)
    q = pk.to_backend(rng.random((1, 2, 16, 16), f32), be)
    k = pk.to_backend(rng.random((1, 2, 16, 16), f32), be)
    v = pk.to_backend(rng.random((1, 2, 16, 16), f32), be)
    big = pk.to_backend(rng.random((2, 16, 16), f32), be)  # out shares big's buffer
    import pyopencl.array as cla

    first = cla.Array(be.queue, (16, 16), f32, data=big.base_data)  # type: ignore[attr-defined]
    return [("matmul", (a, b), a), ("matmul", (a, b), b), ("softmax", (a,), a),
            ("attention", (q, k, v), q), ("attention", (q, k, v), v),
            ("matmul", (big[0].copy(), b), b), ("softmax", (big,), None),
            ("matmul", (first, b), None)]


def test_opencl_out_aliasing_an_input_is_refused() -> None:
    """The issue's silent garbage: ``pk.call("matmul", a, b, out=a)`` (max error 303). Every
    op, every operand; also an out= that is another Array over the same buffer."""
    be = _opencl()
    for op, args, out in _alias_cases(be):
        if out is None:
            continue
        for _ in range(2):  # general path, then the planned/call-site path
            with pytest.raises(pk.PortakernError, match="overlaps input") as info:
                pk.call(op, *args, backend=be, out=out)
            assert isinstance(info.value, pk.InvalidArgumentError)
    _, (first, b), _ = _alias_cases(be)[-1]
    import pyopencl.array as cla

    other = cla.Array(be.queue, (16, 16), f32, data=first.base_data)  # same buffer, no offset
    with pytest.raises(pk.InvalidArgumentError, match="overlaps input 'a'"):
        pk.call("matmul", first, b, backend=be, out=other)
    fresh = pk.call("matmul", first, b, backend=be)  # and a separate out= is fine
    res = pk.call("matmul", first, b, backend=be, out=cla.empty_like(fresh))
    np.testing.assert_allclose(res.get(), fresh.get(), rtol=1e-6)


def test_numpy_memory_overlap_is_judged_by_the_default_span() -> None:
    """Backends without a device buffer model (numpy, CuPy through its array interface) use
    ``Backend.memory_span``: overlapping views of one array alias, disjoint ones do not."""
    be = selection.get("numpy")
    base = np.zeros((8, 8), f32)
    from portakern.ops import get_op

    spec = get_op("softmax")
    with pytest.raises(pk.InvalidArgumentError, match="overlaps"):
        execute.check_no_alias(be, spec, base[2:6], [("x", base[4:])])
    with pytest.raises(pk.InvalidArgumentError, match="overlaps"):
        execute.check_no_alias(be, spec, base[::-1], [("x", base[7:])])
    execute.check_no_alias(be, spec, base[:4], [("x", base[4:])])  # disjoint halves
    execute.check_no_alias(be, spec, base[:4], [("x", np.zeros(3, f32))])


_ZERO_STRIDE = """
import numpy as np, portakern as pk
x = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (2**31 - 1,), (0,))
for b in {targets!r}:
    try:
        pk.softmax(x, backend=b)
        print(b, "computed")
    except pk.PortakernError as exc:
        print(b, type(exc).__name__, "|", exc)
"""


def test_zero_stride_input_is_judged_before_any_copy() -> None:
    """4 bytes claiming 8 GB: refused from its shape (DeviceMemoryError over OpenCL's
    max_mem_alloc_size, HostMemoryError over the host budget), before any copy is made. Run
    in a child under an 8 GB address-space limit, so a regression fails (PoCL aborted on an
    assertion, the process was killed) instead of exhausting this machine."""
    from conftest import TARGETS

    targets = [t for t in TARGETS if t != "jax:pallas"]
    code = _ZERO_STRIDE.format(targets=targets)
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, preexec_fn=limit, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert set(lines) == set(targets), r.stdout
    for t, res in lines.items():
        kind, _, msg = res.partition(" | ")
        assert kind in ("DeviceMemoryError", "HostMemoryError"), (t, res)
        assert "8589934588 bytes" in msg and "Nothing was allocated" in msg, (t, msg)


@pytest.mark.parametrize("op", ["softmax", "matmul"])
def test_host_memory_budget_is_enforced_from_shapes(target: str, op: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A stated budget ($PORTAKERN_HOST_MEMORY_BUDGET) and a broadcast input whose copies
    exceed it: HostMemoryError naming every part and the budget; nothing copied or moved."""
    from portakern.core import host

    monkeypatch.setenv(host.ENV_BUDGET, "100M")
    be = selection.get(target)
    n = 1 << 24  # 64 MiB as float32: the copy alone fits, the call's copies together do not
    x = np.lib.stride_tricks.as_strided(np.zeros(1, f32), (n // 1024, 1024), (0, 0))
    args = (x,) if op == "softmax" else (x, np.ones((1024, 8), f32))
    before = be.transfers.snapshot()
    copies: list[int] = []
    monkeypatch.setattr(host, "native_byte_order", lambda a: copies.append(1) or a)
    with pytest.raises(pk.PortakernError) as info:
        pk.call(op, *args, backend=be)
    assert isinstance(info.value, MemoryError), info.value
    msg = str(info.value)
    assert "budget of 104857600 bytes" in msg or "max_mem_alloc_size" in msg, msg
    assert be.transfers.snapshot() == before and not copies
    monkeypatch.delenv(host.ENV_BUDGET)
    np.testing.assert_allclose(np.asarray(pk.softmax(X_SMALL, backend=be)).sum(), 4, rtol=1e-5)


X_SMALL = np.ones((4, 6), f32)


def test_memory_budget_reads_the_environment_and_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from portakern.core import host

    monkeypatch.setenv(host.ENV_BUDGET, "2G")
    budget, why = host.memory_budget()
    assert budget == 2 << 30 or (budget < 2 << 30 and "RLIMIT_AS" in why), (budget, why)
    monkeypatch.setenv(host.ENV_BUDGET, "lots")
    with pytest.raises(pk.InvalidArgumentError, match="PORTAKERN_HOST_MEMORY_BUDGET"):
        host.memory_budget()
    monkeypatch.delenv(host.ENV_BUDGET)
    budget, why = host.memory_budget()
    assert budget > 0 and why


def test_a_backend_class_missing_a_part_is_refused_when_it_is_loaded() -> None:
    """A backend is its required members (backend/base.py: the allocator, compiler and
    program parts, probing, devices): a class that lacks any is refused when the registry
    loads it, naming what is missing, not at its first call."""

    class NoProgram(KernelBackend):
        name = "noprogram"

        @classmethod
        def _probe(cls) -> Any:
            raise AssertionError("never probed")

    registry.register_backend("noprogram", NoProgram)
    try:
        got = registry.load("noprogram")
        assert not isinstance(got, type)
        for member in ("_open", "buffer_arg", "compile", "empty", "program", "to_native"):
            assert member in got.reason
        assert "allocator, a compiler and a program" in got.fix
        with pytest.raises(pk.BackendUnavailable, match="does not implement"):
            selection.get("noprogram")
    finally:
        assert registry.unregister_backend("noprogram")

"""OpenCL devices by name and the default device's rule (backend/opencl_devices.py), and
launches that never ask a driver for a kernel's program (Intel's CPU runtime refuses:
clRetainProgram INVALID_PROGRAM)."""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.backend.base import DeviceInfo
from portakern.core.errors import UnknownBackendError
from portakern.runtime import selection


def _dev(index: int, kind: str, alias: str, simulator: bool = False) -> DeviceInfo:
    extra = {"alias": alias, **({"simulator": True} if simulator else {})}
    return DeviceInfo(index=index, name=f"dev{index}", kind=kind, extra=extra)


def _opencl_devices() -> list[dict]:
    info = pk.backends()["opencl"]
    if not info["available"]:
        pytest.skip("opencl unavailable: " + info["reason"])
    return info["devices"]


def test_platform_aliases() -> None:
    from portakern.backend.opencl_devices import platform_alias

    assert platform_alias("Portable Computing Language") == "pocl"
    assert platform_alias("Intel(R) OpenCL") == "intel"
    assert platform_alias("Oclgrind") == "oclgrind"
    assert platform_alias("NVIDIA CUDA") == "nvidia"
    assert platform_alias("Some New-Vendor OpenCL") == "some"


def test_default_rule_gpu_then_accelerator_then_pocl_then_loader_order() -> None:
    from portakern.backend.opencl_devices import default_device

    intel, pocl = _dev(0, "cpu", "intel"), _dev(1, "cpu", "pocl")
    sim = _dev(2, "gpu", "oclgrind", simulator=True)
    assert default_device([intel, pocl, sim]) is pocl  # PoCL before the loader's order
    assert default_device([intel, sim]) is intel  # never the simulator
    gpu = _dev(3, "gpu", "nvidia")
    assert default_device([intel, pocl, gpu]) is gpu
    acc = _dev(4, "accelerator", "intelfpga")
    assert default_device([intel, acc]) is acc
    assert default_device([sim]) is None


def test_selection_by_name_shares_the_index_instance() -> None:
    devs = _opencl_devices()
    for d in devs:
        alias = d["extra"]["alias"]
        assert selection.get(f"opencl:{alias}") is selection.get(f"opencl:{d['index']}")


def test_unknown_name_lists_the_devices() -> None:
    devs = _opencl_devices()
    with pytest.raises(UnknownBackendError) as info:
        selection.get("opencl:nosuchvendor")
    msg = str(info.value)
    assert "opencl:nosuchvendor names no OpenCL device" in msg
    assert all(f"opencl:{d['extra']['alias']}" in msg for d in devs), msg


def test_explain_states_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    _opencl_devices()
    from portakern.backend.opencl import OpenCLBackend

    got = OpenCLBackend.auto_choices()
    assert got and "the default OpenCL device: the first GPU" in got[0][2]
    monkeypatch.delenv("PORTAKERN_BACKEND", raising=False)
    if selection.automatic()[0].startswith("opencl"):
        assert "the default OpenCL device: the first GPU" in pk.explain()


def test_programs_are_made_from_the_kept_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch objects come from the program compile() kept, never from ``kernel.program``
    (which asks the driver, and Intel's CPU runtime answers INVALID_PROGRAM): a kernel class
    whose ``program`` raises still launches, on the runner's path and the checked one."""
    devs = _opencl_devices()
    be = selection.get(f"opencl:{devs[0]['index']}")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = pk.to_backend(a, be.label)
    import pyopencl as cl

    def refuse(self: object) -> object:
        raise cl.LogicError("clRetainProgram failed: INVALID_PROGRAM (simulated)")

    monkeypatch.setattr(cl.Kernel, "program", property(refuse), raising=False)
    for _ in range(3):  # cold (checked path), then the planned runner
        got = pk.softmax(x, axis=-1, backend=be.label).get()
        want = np.exp(a - a.max(-1, keepdims=True))
        np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5)


def test_automatic_selection_follows_the_arrays_device() -> None:
    """Arrays made on one OpenCL device run there with no backend= (the simulator is a
    second device on every machine the set-up made; Intel's runtime, when present, a third):
    alternating devices with one shape and dtype, so the second call of each finds the first
    device's plan under its key, and must still run where its inputs live."""
    devs = [d for d in _opencl_devices() if d["extra"].get("alias")]
    if len(devs) < 2:
        pytest.skip("one OpenCL device here: nothing to follow")
    a = np.random.default_rng(0).standard_normal((4, 33)).astype(np.float32)
    want = np.exp(a - a.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    labels = [f"opencl:{d['index']}" for d in devs]
    for label in labels + labels:
        be = selection.get(label)
        x = pk.to_backend(a, label)
        got = pk.softmax(x, axis=-1)
        assert got.context == be.ctx, (label, "ran on another device")
        np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-7)
        # the automatic key's plan is now this device's: the next call takes its runner
        from portakern.ops import get_op
        from portakern.runtime.plan import PLANS, plan_key

        # (pk.softmax leaves out an axis that is its own default: tests/test_api_defaults.py)
        plan = PLANS.lookup(plan_key(get_op("softmax"), (x,), {}))
        assert plan is not None and plan.backend is be and plan.follows_inputs


def test_half_path_on_a_device_with_fp16_arithmetic() -> None:
    """A device that reports cl_khr_fp16 (Intel's CPU runtime: fp16 arithmetic runs for real
    there) takes the same half path as every OpenCL device: float16 is a storage type only,
    loaded with vload_half and stored with vstore_half_rte, and every sum runs in float. So
    the rendered source enables no cl_khr_fp16 and declares no half variable, and a float16
    matmul over K = 4096 (a half accumulator would be ~50x beyond the float32-accumulation
    bound) and a softmax over 4096 agree with the float64 oracle there."""
    from portakern.ops import get_op
    from portakern.runtime.verify import compare_arrays

    devs = [d for d in _opencl_devices() if d["extra"].get("fp16_arith")
            and not d["extra"].get("simulator")]
    if not devs:
        pytest.skip("no OpenCL device here reports cl_khr_fp16 (the set-up's Intel runtime "
                    "does: pip install 'portakern[intel]')")
    rng = np.random.default_rng(5)
    a = rng.standard_normal((8, 4096)).astype(np.float16)
    b = rng.standard_normal((4096, 8)).astype(np.float16)
    x = rng.standard_normal((4, 4096)).astype(np.float16)
    for d in devs:
        label = f"opencl:{d['index']}"
        for op, arrays, params in (("matmul", {"a": a, "b": b}, {}),
                                   ("softmax", {"x": x}, {"axis": -1})):
            spec = get_op(op)
            bound, bparams = spec.bind((), {**arrays, **params})
            prob = spec.problem(bound, bparams)
            src = spec.render("opencl", prob, spec.config("cpu", None, prob))
            assert "cl_khr_fp16" not in src and "vload_half" in src, op
            assert not any(line.lstrip().startswith("half ") for line in src.splitlines())
            got = pk.call(spec, backend=label, **arrays, **params)
            verdict = compare_arrays(spec, bound, bparams, got)
            assert verdict.ok, f"{op} float16 on {label}:\n{verdict}"


def test_tuning_entries_are_kept_per_implementation() -> None:
    """PoCL and Intel's runtime on one CPU are two implementations: the tuner's store key
    (the device fingerprint) differs between them and names each readably."""
    from portakern.runtime import configs

    devs = [d for d in _opencl_devices() if not d["extra"].get("simulator")]
    keys = {configs.device_key(configs.fingerprint(selection.get(f"opencl:{d['index']}")))
            for d in devs}
    assert len(keys) == len(devs), keys
    for d in devs:
        key = configs.device_key(configs.fingerprint(selection.get(f"opencl:{d['index']}")))
        assert key.startswith(f"opencl_{d['extra']['alias']}-"), key

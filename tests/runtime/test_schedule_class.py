"""Which default schedule a device starts from: its schedule class.

Why: the CPU schedules are register blocks written for AVX-512 (32 zmm registers, 16 lanes).
On an AVX2 CPU (16 ymm registers, 8 lanes) their 16-lane blocks take two registers each and
spill: matmul ran 1.5-1.9x and attention 1.3x slower than blocks sized for AVX2 (side by side
on a 2-core AMD EPYC). A device whose native float vectors are 256 bits starts from a spec's
'cpu256' schedule; a spec without one falls back to 'cpu', then to 'gpu'. The choice is data
in the spec, never a branch in a kernel.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from portakern.backend.base import Backend, DeviceInfo
from portakern.core.spec import schedule_family
from portakern.ops import get_op
from portakern.runtime import configs, selection


class _Device:
    """The part of a Backend that schedule_class reads."""

    device_class = Backend.device_class
    schedule_class = Backend.schedule_class

    def __init__(self, kind: str, bits: int | None) -> None:
        extra = {} if bits is None else {"vector_bits": bits}
        self.device = DeviceInfo(index=0, name="x", kind=kind, extra=extra)


@pytest.mark.parametrize("kind,bits,want", [("cpu", 256, "cpu256"), ("cpu", 512, "cpu"),
                                            ("cpu", 128, "cpu"), ("cpu", None, "cpu"),
                                            ("gpu", 256, "gpu"), ("accelerator", None, "gpu")])
def test_schedule_class_follows_the_native_vector_width(kind: str, bits: int | None,
                                                        want: str) -> None:
    assert _Device(kind, bits).schedule_class == want


def test_fallback_is_class_then_family_then_gpu() -> None:
    assert schedule_family("cpu256") == "cpu" and schedule_family("gpu") == "gpu"
    mm, sm = get_op("matmul"), get_op("rmsnorm")  # rmsnorm: no cpu256 schedule of its own
    assert mm.schedule_for("cpu256") is mm.schedules["cpu256"]
    assert mm.schedule_for("cpu") is mm.schedules["cpu"]
    assert "cpu256" not in sm.schedules
    assert sm.schedule_for("cpu256") is sm.schedules["cpu"]  # its family
    assert sm.schedule_for("tpu") is sm.schedules["gpu"]
    # the AVX2 blocks: 12 ymm accumulators (matmul), 2-row blocks (attention)
    c256 = mm.config("cpu256")
    assert c256["VEC"] == 8 and c256["TM"] * c256["TN"] == 12
    assert get_op("attention").config("cpu256")["TQ"] == 2


def _opencl(alias: str):  # noqa: ANN202
    pytest.importorskip("pyopencl")
    from portakern.backend import registry

    av = registry.availability("opencl")
    dev = next((d for d in av.devices if d.extra.get("alias") == alias), None) \
        if av.available else None
    if dev is None:
        pytest.skip(f"opencl:{alias} is not installed here")
    return selection.get(f"opencl:{alias}"), dev


@pytest.mark.parametrize("alias", ["pocl", "intel"])
def test_a_real_device_reports_its_width_and_gets_its_schedule(alias: str) -> None:
    be, dev = _opencl(alias)
    bits = dev.extra["vector_bits"]
    assert bits in (128, 256, 512)
    mm = get_op("matmul")
    prob = mm.problem({"a": np.zeros((64, 64), np.float32), "b": np.zeros((64, 64), np.float32)},
                      dict(mm.params))
    got = configs.config_for(be, mm, prob, None) if not configs.lookup(be, mm, prob) else None
    if got is None:
        pytest.skip("a tuned entry decides this device's config")
    want = mm.schedules["cpu256" if bits == 256 else "cpu"]
    assert {k: got[k] for k in ("TM", "TN", "VEC")} == {k: want[k] for k in ("TM", "TN", "VEC")}


def test_host_flags_raise_a_cpu_devices_width(tmp_path) -> None:  # noqa: ANN001
    """A runtime reporting 8 floats on an AVX-512 host still gets the AVX-512 schedules."""
    from portakern.backend import opencl_devices as od

    def info(flags: str) -> str:
        f = tmp_path / f"cpuinfo-{len(flags)}"
        f.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
        return str(f)

    assert od.host_vector_bits(info("avx avx2 fma avx512f avx512bw")) == 512
    assert od.host_vector_bits(info("avx avx2 fma")) == 256
    assert od.host_vector_bits(info("sse4_2")) == 0
    assert od.host_vector_bits(str(tmp_path / "missing")) == 0


def test_a_cpu_tuning_entry_is_kept_per_host_cpu(tmp_path: pathlib.Path) -> None:
    """A CPU device's tuning fingerprint carries the host's CPU model and vector flags: jax
    names every CPU 'cpu', so without them a config tuned on an AVX-512 Xeon would be read
    on an AVX2 EPYC (one VM image, two machines). GPU fingerprints do not change."""
    def cpuinfo(model: str, flags: str) -> str:
        f = tmp_path / f"{model.split()[0]}.txt"
        f.write_text(f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n")
        return str(f)

    xeon = configs.host_cpu(cpuinfo("Intel(R) Xeon(R)  Processor", "fpu avx2 fma avx512f"))
    epyc = configs.host_cpu(cpuinfo("AMD EPYC", "fpu avx avx2 fma sme"))  # (x86 sme: no SIMD)
    assert (xeon, epyc) == ("Intel(R) Xeon(R) Processor [avx2 fma avx512f]", "AMD EPYC [avx2 fma]")
    assert configs.host_cpu(str(tmp_path / "missing")) == ""
    # an Arm host (no 'model name'): implementer and part name the core, Features the vectors
    n1, v1 = tmp_path / "n1.txt", tmp_path / "v1.txt"
    n1.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm crc32\n"
                  "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd0c\n")
    v1.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
                  "CPU implementer\t: 0x41\nCPU part\t: 0xd40\n")
    assert configs.host_cpu(str(n1)) == "arm 0x41:0xd0c [asimd]"
    assert configs.host_cpu(str(v1)) == "arm 0x41:0xd40 [asimd sve bf16 i8mm]"
    blank = tmp_path / "blank.txt"  # an empty first value: the next non-empty one counts
    blank.write_text("model name\t:\nflags\t:\nmodel name\t: AMD EPYC\nflags\t: avx2\n")
    assert configs.host_cpu(str(blank)) == "AMD EPYC [avx2]"
    cpu = DeviceInfo(index=0, name="cpu", kind="cpu", vendor="", driver="jaxlib", platform="cpu")
    keys = set()
    for host in (xeon, epyc):
        configs._HOST_CPU["/proc/cpuinfo"] = host
        try:
            fp = configs.fingerprint_of("jax", cpu, {"jax": "1"})
        finally:
            configs._HOST_CPU.pop("/proc/cpuinfo")
        assert fp["host_cpu"] == host
        keys.add(configs.device_key(fp))
    assert len(keys) == 2
    gpu = DeviceInfo(index=0, name="H200", kind="gpu", vendor="NVIDIA", driver="5", platform="cuda")
    assert "host_cpu" not in configs.fingerprint_of("cuda", gpu, {})

"""The one C-style renderer: a kernel source in portakern's macro dialect -> OpenCL C / CUDA / HIP.

Like tinygrad's cstyle renderer, the dialects differ only by data: each entry of ``DIALECTS``
spells the handful of macros a kernel uses (qualifiers, ids, barrier, math, bit casts, headers).
``render`` prepends that preamble, the dtype slots (``PK_T_<slot>``, ``PK_ACC_<slot>``,
``PK_LOAD_<slot>``, ``PK_STORE_<slot>``) and the tunables as ``#define``s to the op's source.
Nothing else changes between vendors, so one kernel is reviewed, tested and tuned once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from . import dtypes
from .errors import SpecError


@dataclass(frozen=True)
class Dialect:
    name: str
    headers: str
    kernel: str  # qualifier in front of a kernel entry point
    device_fn: str  # qualifier of helper functions
    global_: str
    local: str
    restrict: str
    barrier: str
    group_id: str  # format with {d}
    local_id: str
    local_size: str
    num_groups: str
    as_float: str  # reinterpret uint bits as float: format with {x}
    as_uint: str
    infinity: str
    fp64_pragma: str = ""
    vectors: bool = False  # native vector types with arithmetic (OpenCL floatN); CUDA has none
    # PK_LAUNCH_BOUNDS(n, m) in front of a kernel's name: launched with at most n work-items
    # per group, and m such groups should fit on one multiprocessor at once. CUDA:
    # __launch_bounds__(n, m) (ptxas then keeps registers low enough for m blocks per SM). HIP:
    # __launch_bounds__(n) only (its second argument means waves per SIMD, another unit);
    # without it clang assumes 1024-item groups and caps a kernel at 128 VGPRs, spilling the
    # rest to scratch. OpenCL: nothing (the runtime is told the group size at launch).
    launch_bounds: str = ""  # format with {n} and {m}
    extra: str = ""
    option_defaults: tuple[str, ...] = field(default=())
    # the spec schedule a kernel in this dialect is shown with when no device is at hand
    # (`portakern show --backend cuda` on a machine without a GPU)
    device_class: str = "cpu"


_CUDA_IDS = "((({d}) == 0) ? {v}.x : (({d}) == 1) ? {v}.y : {v}.z)"

DIALECTS: dict[str, Dialect] = {
    "opencl": Dialect(
        name="opencl",
        headers="",
        kernel="__kernel",
        device_fn="static inline",
        global_="__global",
        local="__local",
        restrict="restrict",
        barrier="barrier(CLK_LOCAL_MEM_FENCE)",
        group_id="((int)get_group_id({d}))",
        local_id="((int)get_local_id({d}))",
        local_size="((int)get_local_size({d}))",
        num_groups="((int)get_num_groups({d}))",
        as_float="as_float({x})",
        as_uint="as_uint({x})",
        infinity="INFINITY",
        fp64_pragma="#pragma OPENCL EXTENSION cl_khr_fp64 : enable",
        vectors=True,
    ),
    "cuda": Dialect(
        name="cuda",
        device_class="gpu",
        headers="#include <cuda_fp16.h>",
        kernel='extern "C" __global__',
        device_fn="static __device__ __forceinline__",
        global_="",
        local="__shared__",
        restrict="__restrict__",
        barrier="__syncthreads()",
        group_id="((int)" + _CUDA_IDS.replace("{v}", "blockIdx") + ")",
        local_id="((int)" + _CUDA_IDS.replace("{v}", "threadIdx") + ")",
        local_size="((int)" + _CUDA_IDS.replace("{v}", "blockDim") + ")",
        num_groups="((int)" + _CUDA_IDS.replace("{v}", "gridDim") + ")",
        as_float="__uint_as_float({x})",
        as_uint="__float_as_uint({x})",
        infinity="__int_as_float(0x7f800000)",
        launch_bounds="__launch_bounds__({n}, {m})",
    ),
}
# AMD through CuPy-ROCm/hipRTC: HIP accepts the CUDA spellings, so it is CUDA's entry with only
# what differs overridden: the fp16 header, and __launch_bounds__ with one argument (its second
# means waves per SIMD in HIP, not blocks per multiprocessor). Rendered and documented, not yet
# run on AMD hardware. A new field of Dialect reaches hip from cuda unless listed here.
DIALECTS["hip"] = replace(
    DIALECTS["cuda"],
    name="hip",
    headers="#include <hip/hip_fp16.h>",
    launch_bounds="__launch_bounds__({n})",
)

# Written once for every dialect, in terms of the macros above.
COMMON_PREAMBLE = """\
#define PK_INF_F PK_INFINITY
PK_DEVICE_FN float pk_bf16_to_float(unsigned short b) {
    return PK_AS_FLOAT(((unsigned int)b) << 16);
}
PK_DEVICE_FN unsigned short pk_float_to_bf16(float f) {
    unsigned int u = PK_AS_UINT(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (unsigned short)(u >> 16);
}
"""


def _macro_block(d: Dialect) -> str:
    lines = [
        f"#define PK_KERNEL {d.kernel}",
        f"#define PK_DEVICE_FN {d.device_fn}",
        f"#define PK_GLOBAL {d.global_}",
        f"#define PK_LOCAL {d.local}",
        f"#define PK_RESTRICT {d.restrict}",
        f"#define PK_BARRIER() {d.barrier}",
        f"#define PK_GROUP_ID(d) {d.group_id.format(d='d')}",
        f"#define PK_LOCAL_ID(d) {d.local_id.format(d='d')}",
        f"#define PK_LOCAL_SIZE(d) {d.local_size.format(d='d')}",
        f"#define PK_NUM_GROUPS(d) {d.num_groups.format(d='d')}",
        f"#define PK_AS_FLOAT(x) {d.as_float.format(x='(x)')}",
        f"#define PK_AS_UINT(x) {d.as_uint.format(x='(x)')}",
        f"#define PK_INFINITY {d.infinity}",
        f"#define PK_HAS_VECTOR {int(d.vectors)}",
        f"#define PK_LAUNCH_BOUNDS(n, m) {d.launch_bounds.format(n='n', m='m')}",
        "#define PK_CAT_(a, b) a##b",
        "#define PK_CAT(a, b) PK_CAT_(a, b)",
    ]
    return "\n".join(lines)


def _identifier(name: str, what: str) -> str:
    if not name.isidentifier() or not name.isascii():
        raise SpecError(f"{what} {name!r} is not a C identifier; use letters, digits and _.")
    return name


def _define_value(name: str, value: object) -> str:
    """Only integers and plain floats may become #define values: nothing else reaches source."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        r = repr(float(value))
        if r in ("inf", "-inf", "nan"):
            raise SpecError(f"define {name}={value!r}: non-finite floats cannot be #defined.")
        return r
    raise SpecError(f"define {name}={value!r} has type {type(value).__name__}; "
                    "expected int, bool or float (strings never reach kernel source).")


def render(source: str, dialect: str, *, slots: Mapping[str, object],
           defines: Mapping[str, object]) -> str:
    """Render a kernel source for one dialect.

    slots: dtype slot name -> dtype, e.g. {"T": float16} gives PK_T_T, PK_ACC_T,
    PK_LOAD_T(p, i), PK_STORE_T(p, i, v). defines: tunables and compile-time constants.
    """
    try:
        d = DIALECTS[dialect]
    except KeyError:
        raise SpecError(f"unknown dialect {dialect!r}; expected one of {sorted(DIALECTS)}"
                        ) from None
    parts = [f"/* portakern: rendered for {dialect} */"]
    if d.headers:
        parts.append(d.headers)
    if any(dtypes.info(dt).needs_fp64 for dt in slots.values()) and d.fp64_pragma:
        parts.append(d.fp64_pragma)
    parts.append(_macro_block(d))
    parts.append(COMMON_PREAMBLE)
    for slot, dt in slots.items():
        _identifier(slot, "dtype slot")
        sp = dtypes.spelling(dialect, dt)
        parts.append(f"#define PK_T_{slot} {sp.storage}")
        parts.append(f"#define PK_ACC_{slot} {sp.acc}")
        parts.append(f"#define PK_LOAD_{slot}(p, i) {sp.load}")
        parts.append(f"#define PK_STORE_{slot}(p, i, v) {sp.store}")
        # storage == compute type: plain pointer reads, so vector loads (vloadN) are valid
        parts.append(f"#define PK_PLAIN_{slot} {int(sp.storage == sp.acc)}")
        acc_is_float = int(dtypes.info(dt).compute.name == "float32")  # float vector helpers
        parts.append(f"#define PK_ACC_IS_FLOAT_{slot} {acc_is_float}")
    for name, value in sorted(defines.items()):
        _identifier(name, "define")
        parts.append(f"#define {name} {_define_value(name, value)}")
    parts.append(source)
    return "\n".join(parts) + "\n"


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]

"""The one C-style renderer: a kernel source in portakern's macro dialect -> OpenCL C / CUDA / HIP.

Like tinygrad's cstyle renderer, the dialects differ only by data: each entry of ``DIALECTS``
spells the handful of macros a kernel uses (qualifiers, ids, barrier, math, bit casts, headers).
``render`` prepends that preamble, the dtype slots (``PK_T_<slot>``, ``PK_ACC_<slot>``,
``PK_LOAD_<slot>``, ``PK_STORE_<slot>``) and the tunables as ``#define``s to the op's source.
Nothing else changes between vendors, so one kernel is reviewed, tested and tuned once.
"""

from __future__ import annotations

import hashlib
import re
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
    # Matrix units (docs/fragments.md): the fragment lowerings this dialect can emit, by
    # name (FRAGMENTS), and which device reaches which: (regular expression over the
    # device's `arch` text -- 'sm_80', 'gfx90a', an OpenCL device's extension list -- and
    # the lowering), first match wins. A device that matches none runs the emulation
    # (EMULATION, a lane map chosen by PORTAKERN_MMA_LAYOUT) when a kernel asks for it.
    matrix_units: tuple[tuple[str, str], ...] = ()
    # the pointer qualifier of local/shared memory in a helper function's parameter
    # (OpenCL: __local; CUDA/HIP: none, a generic pointer)
    local_ptr: str = ""
    # PK_PREFETCH(p): a hint that the cache line at p is read soon (format with {p}); it
    # changes no value. OpenCL CPU runtimes leave OpenCL's own prefetch() empty, while
    # clang's __builtin_prefetch becomes a prefetch instruction (PoCL, Intel): a CPU kernel
    # streaming pages it reaches through a table (paged decode) fetches the next page while
    # it computes on this one. Empty: no hint. A build defining PK_NO_PREFETCH gets none
    # either (the simulator: Oclgrind 21.10 cannot run llvm.prefetch).
    prefetch: str = ""
    # PK_PREFETCH_ONCE(p): the same hint for a line read once and then not again soon (format
    # with {p}): a non-temporal prefetch (x86 prefetchnta) brings it near the core without
    # displacing what the caches hold for longer, the stack's spilled registers among it.
    # Paged decode's K/V rows: 10-20% faster than PK_PREFETCH on an AVX2 EPYC (PoCL and
    # Intel). Empty: PK_PREFETCH. -DPK_NO_PREFETCH turns this one off too.
    prefetch_once: str = ""
    # PK_PREFETCH_OUTER(p): the same hint, into the outer caches only (format with {p}):
    # x86 prefetcht2 (clang's locality 1) fills L2, not L1. Paged decode's next chunk on a
    # 2-core AMD EPYC Zen 4 (AVX-512): 1.5-1.9x faster than prefetchnta or prefetcht0, which
    # both read 11-13 ms where this reads 6.3-7.3 (B1 x 32768, PoCL and Intel). Empty:
    # PK_PREFETCH_ONCE. -DPK_NO_PREFETCH turns it off.
    prefetch_outer: str = ""
    # PK_STREAM_STORE(v, p): store v at p, which must be aligned to sizeof(v), bypassing the
    # caches (format with {v}, {p}). A plain store of a line no cache holds first reads it
    # (read for ownership): a CPU kernel writing a large output once (softmax's streamed
    # path) moves a third less memory with clang's __builtin_nontemporal_store (PoCL, Intel:
    # vmovntps). x86's locked operations, which every runtime's completion uses, order these
    # stores. Empty, or a build defining PK_NO_STREAM_STORE: a plain store.
    stream_store: str = ""
    # PK_LOOKUP8(t, i): a float8 whose lane l is t[i[l] & 7], t a float8 table and i an int8
    # (format with {t}, {i}), for dialects with vectors. OpenCL's shuffle() says exactly
    # this, but PoCL (LLVM 14/15) lowers it lane by lane through the stack, 16 scalar moves
    # for one lookup, where x86 AVX2 has one instruction (vpermps): with it, vexp.c's
    # table-driven exp is 15-20% faster on PoCL. Taken where the compiler has the builtin
    # and the target has AVX2; else shuffle(). A build defining PK_NO_LOOKUP8 gets shuffle().
    lookup8: str = ""
    lookup8_requires: str = ""  # a preprocessor condition the builtin also needs


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
        local_ptr="__local",
        prefetch="__builtin_prefetch({p})",
        prefetch_once="__builtin_prefetch({p}, 0, 0)",
        prefetch_outer="__builtin_prefetch({p}, 0, 1)",
        stream_store="__builtin_nontemporal_store({v}, {p})",
        lookup8="__builtin_ia32_permvarsf256({t}, {i})",
        lookup8_requires="defined(__AVX2__)",
        matrix_units=((r"\bcl_intel_subgroup_matrix_multiply_accumulate\b", "intel"),),
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
        # mma.sync m16n8k16 with f16/bf16 inputs: sm_80 (Ampere) and every later architecture
        # (sm_90's wgmma is a different, warpgroup-wide API: FRAGMENTS' note)
        matrix_units=((r"^sm_(8\d|9\d|1\d\d)a?$", "sm80"),),
    ),
}
# AMD through CuPy-ROCm/hipRTC: HIP accepts the CUDA spellings, so it is CUDA's entry with only
# what differs overridden: the fp16 header, and __launch_bounds__ with one argument (its second
# means waves per SIMD in HIP, not blocks per multiprocessor). Rendered and documented, not yet
# run on AMD hardware. A new field of Dialect reaches hip from cuda unless listed here.
# Ids, sizes and the barrier are the compiler's own builtins (what HIP's headers expand to
# through the device libraries, ockl): a kernel then needs no device library at all, so it
# builds for gfx1100 too, for which Debian's ROCm ships none (hipcc -nogpulib).
_HIP_IDS = ("((int)(({d}) == 0 ? __builtin_amdgcn_{f}_x() : ({d}) == 1 ? "
            "__builtin_amdgcn_{f}_y() : __builtin_amdgcn_{f}_z()))")
DIALECTS["hip"] = replace(
    DIALECTS["cuda"],
    name="hip",
    headers="#include <hip/hip_fp16.h>",
    launch_bounds="__launch_bounds__({n})",
    barrier=('do { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup"); '
             '__builtin_amdgcn_s_barrier(); '
             '__builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup"); } while (0)'),
    group_id=_HIP_IDS.replace("{f}", "workgroup_id"),
    local_id=_HIP_IDS.replace("{f}", "workitem_id"),
    local_size=_HIP_IDS.replace("{f}", "workgroup_size"),
    num_groups=("((int)(({d}) == 0 ? " + " : ({d}) == 1 ? ".join(
        f"(__builtin_amdgcn_grid_size_{x}() + __builtin_amdgcn_workgroup_size_{x}() - 1) / "
        f"__builtin_amdgcn_workgroup_size_{x}()" for x in "xy")
        + " : (__builtin_amdgcn_grid_size_z() + __builtin_amdgcn_workgroup_size_z() - 1) / "
        "__builtin_amdgcn_workgroup_size_z()))"),
    # CDNA (gfx90a, gfx94x: MFMA 16x16x16 with bf16_1k) and RDNA3 (gfx11: WMMA, wave32)
    matrix_units=((r"^gfx9(0a|4\d)$", "cdna"), (r"^gfx11\d\d$", "rdna3")),
)

# --- matrix units: the fragment API's lowerings (docs/fragments.md) -------------------------
@dataclass(frozen=True)
class Fragment:
    """One vendor's 16x16x16 matrix tile (A 16x16 and B 16x16 in fp16/bf16, C 16x16 fp32),
    owned by one wave of ``wave`` lanes: where element ``i`` of lane ``l``'s A, B and C
    registers sits in its tile (C expressions in ``l`` and ``i``), and, per dialect, the
    native code of one tile product (C source defining ``pk_mma_native_f16`` and
    ``pk_mma_native_bf16(pk_frag_c*, const pk_frag_a*, const pk_frag_b*)``). A dialect
    without native code for it runs the emulation of ``portakern/ops/mma.c`` with this lane
    map. ``a_owner``/``b_owner``: in a layout that holds an element in several lanes
    (RDNA3 repeats A and B in both half-waves), the lane whose copy is the original."""

    name: str
    wave: int
    a_elems: int
    b_elems: int
    c_elems: int
    a_row: str
    a_col: str
    b_row: str
    b_col: str
    c_row: str
    c_col: str
    a_owner: str = "1"
    b_owner: str = "1"
    native: Mapping[str, str] = field(default_factory=dict)  # dialect -> C source
    kernel_attr: Mapping[str, str] = field(default_factory=dict)  # dialect -> attribute
    doc: str = ""


# NVIDIA sm_80+: mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16} twice (two n8 halves).
# PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type": groupID = l >> 2,
# threadID_in_group = l & 3; A a0..a3 (two halves each, the lower index in the low 16 bits),
# B b0 b1 per n8 half, C c0..c3 per n8 half.
_SM80_NATIVE = r"""
#define PK_MMA_SM80_(ty, c, ra, rb0, rb1, o) \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty ".f32 " \
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \
        : "+f"((c)->x[(o)]), "+f"((c)->x[(o) + 1]), "+f"((c)->x[(o) + 2]), \
          "+f"((c)->x[(o) + 3]) \
        : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "r"(rb0), "r"(rb1))
#define PK_MMA_SM80_PACK(a, b, ra, rb) \
    unsigned int ra[4], rb[4]; \
    for (int j_ = 0; j_ < 4; ++j_) { \
        ra[j_] = (unsigned int)(a)->x[2 * j_] | ((unsigned int)(a)->x[2 * j_ + 1] << 16); \
        rb[j_] = (unsigned int)(b)->x[2 * j_] | ((unsigned int)(b)->x[2 * j_ + 1] << 16); \
    }
PK_DEVICE_FN void pk_mma_native_f16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_SM80_PACK(a, b, ra, rb)
    PK_MMA_SM80_("f16", c, ra, rb[0], rb[1], 0);
    PK_MMA_SM80_("f16", c, ra, rb[2], rb[3], 4);
}
PK_DEVICE_FN void pk_mma_native_bf16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_SM80_PACK(a, b, ra, rb)
    PK_MMA_SM80_("bf16", c, ra, rb[0], rb[1], 0);
    PK_MMA_SM80_("bf16", c, ra, rb[2], rb[3], 4);
}
"""

# AMD CDNA (gfx90a, gfx94x): v_mfma_f32_16x16x16f16 / _16x16x16bf16_1k, one per tile (wave64).
_CDNA_NATIVE = r"""
typedef _Float16 pk_v4h __attribute__((ext_vector_type(4)));
typedef short pk_v4s __attribute__((ext_vector_type(4)));
typedef float pk_v4f __attribute__((ext_vector_type(4)));
#define PK_MMA_CDNA_(builtin, cast, c, a, b) do { \
        pk_v4s va_, vb_; pk_v4f vc_; \
        for (int i_ = 0; i_ < 4; ++i_) { \
            va_[i_] = (short)(a)->x[i_]; vb_[i_] = (short)(b)->x[i_]; vc_[i_] = (c)->x[i_]; \
        } \
        vc_ = builtin(cast(va_), cast(vb_), vc_, 0, 0, 0); \
        for (int i_ = 0; i_ < 4; ++i_) (c)->x[i_] = vc_[i_]; \
    } while (0)
PK_DEVICE_FN void pk_mma_native_f16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_CDNA_(__builtin_amdgcn_mfma_f32_16x16x16f16, (pk_v4h), c, a, b);
}
PK_DEVICE_FN void pk_mma_native_bf16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_CDNA_(__builtin_amdgcn_mfma_f32_16x16x16bf16_1k, , c, a, b);
}
"""

# AMD RDNA3 (gfx11): v_wmma_f32_16x16x16_{f16,bf16} in wave32; A and B are repeated in both
# half-waves (AMD's "How to accelerate AI applications on RDNA 3 using WMMA").
_RDNA3_NATIVE = r"""
typedef _Float16 pk_v16h __attribute__((ext_vector_type(16)));
typedef short pk_v16s __attribute__((ext_vector_type(16)));
typedef float pk_v8f __attribute__((ext_vector_type(8)));
#define PK_MMA_RDNA3_(builtin, cast, c, a, b) do { \
        pk_v16s va_, vb_; pk_v8f vc_; \
        for (int i_ = 0; i_ < 16; ++i_) { \
            va_[i_] = (short)(a)->x[i_]; vb_[i_] = (short)(b)->x[i_]; \
        } \
        for (int i_ = 0; i_ < 8; ++i_) vc_[i_] = (c)->x[i_]; \
        vc_ = builtin(cast(va_), cast(vb_), vc_); \
        for (int i_ = 0; i_ < 8; ++i_) (c)->x[i_] = vc_[i_]; \
    } while (0)
PK_DEVICE_FN void pk_mma_native_f16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_RDNA3_(__builtin_amdgcn_wmma_f32_16x16x16_f16_w32, (pk_v16h), c, a, b);
}
PK_DEVICE_FN void pk_mma_native_bf16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_RDNA3_(__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32, , c, a, b);
}
"""

# Intel GPUs with cl_intel_subgroup_matrix_multiply_accumulate, sub-groups of 8 (the size the
# extension requires on devices whose smallest is 8): intel_sub_group_{f16,bf16}_..._mad_k16
# is an 8x16 (M x K) by 16x8 (K x N) product, so a tile is 2 x 2 of them. a: int8, row m in
# component m, lane l holding k = 2l, 2l + 1; b: int8, column l, k pairs by component;
# acc: float8, row m in component m, column l.
_INTEL_NATIVE = r"""
#pragma OPENCL EXTENSION cl_intel_subgroups : enable
#define PK_MMA_INTEL_(fn, c, a, b) do { \
        for (int h_ = 0; h_ < 2; ++h_) { \
            int tb_[8]; \
            for (int j_ = 0; j_ < 8; ++j_) \
                tb_[j_] = (int)((uint)(b)->x[16 * h_ + 2 * j_] \
                                | ((uint)(b)->x[16 * h_ + 2 * j_ + 1] << 16)); \
            for (int r_ = 0; r_ < 2; ++r_) { \
                int ta_[8]; \
                for (int m_ = 0; m_ < 8; ++m_) \
                    ta_[m_] = (int)((uint)(a)->x[2 * (8 * r_ + m_)] \
                                    | ((uint)(a)->x[2 * (8 * r_ + m_) + 1] << 16)); \
                float8 acc_ = vload8(0, (c)->x + 16 * h_ + 8 * r_); \
                acc_ = fn(vload8(0, ta_), vload8(0, tb_), acc_); \
                vstore8(acc_, 0, (c)->x + 16 * h_ + 8 * r_); \
            } \
        } \
    } while (0)
PK_DEVICE_FN void pk_mma_native_f16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_INTEL_(intel_sub_group_f16_f16_matrix_mad_k16, c, a, b);
}
PK_DEVICE_FN void pk_mma_native_bf16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b) {
    PK_MMA_INTEL_(intel_sub_group_bf16_bf16_matrix_mad_k16, c, a, b);
}
"""

FRAGMENTS: dict[str, Fragment] = {
    "sm80": Fragment(
        "sm80", 32, 8, 8, 8,
        a_row="((l) >> 2) + 8 * (((i) >> 1) & 1)",
        a_col="((l) & 3) * 2 + ((i) & 1) + 8 * ((i) >> 2)",
        b_row="((l) & 3) * 2 + ((i) & 1) + 8 * (((i) >> 1) & 1)",
        b_col="((l) >> 2) + 8 * ((i) >> 2)",
        c_row="((l) >> 2) + 8 * (((i) >> 1) & 1)",
        c_col="((l) & 3) * 2 + ((i) & 1) + 8 * ((i) >> 2)",
        native={"cuda": _SM80_NATIVE},
        doc="NVIDIA sm_80+ (warp 32): 2 x mma.sync.m16n8k16"),
    "cdna": Fragment(
        "cdna", 64, 4, 4, 4,
        a_row="((l) & 15)", a_col="4 * ((l) >> 4) + (i)",
        b_row="4 * ((l) >> 4) + (i)", b_col="((l) & 15)",
        c_row="4 * ((l) >> 4) + (i)", c_col="((l) & 15)",
        native={"hip": _CDNA_NATIVE},
        doc="AMD CDNA gfx90a/gfx94x (wave 64): v_mfma_f32_16x16x16{f16,bf16_1k}"),
    "rdna3": Fragment(
        "rdna3", 32, 16, 16, 8,
        a_row="((l) & 15)", a_col="(i)",
        b_row="(i)", b_col="((l) & 15)",
        c_row="2 * (i) + ((l) >> 4)", c_col="((l) & 15)",
        a_owner="((l) < 16)", b_owner="((l) < 16)",
        native={"hip": _RDNA3_NATIVE},
        doc="AMD RDNA3 gfx11 (wave 32): v_wmma_f32_16x16x16_{f16,bf16}"),
    "intel": Fragment(
        "intel", 8, 32, 32, 32,
        a_row="((i) >> 1)", a_col="2 * (l) + ((i) & 1)",
        b_row="((i) & 15)", b_col="(l) + 8 * ((i) >> 4)",
        c_row="((i) & 15)", c_col="(l) + 8 * ((i) >> 4)",
        native={"opencl": _INTEL_NATIVE},
        kernel_attr={"opencl": "__attribute__((intel_reqd_sub_group_size(8)))"},
        doc="Intel GPUs with cl_intel_subgroup_matrix_multiply_accumulate (sub-group 8): "
            "4 x intel_sub_group_{f16,bf16}_..._matrix_mad_k16"),
}
# Hopper's wgmma (sm_90a: warpgroups of 4 warps, B (and A) read from shared memory through
# descriptors, asynchronous) is not a per-wave register fragment: it would be another entry
# with its own wave (128) and loads that hand out descriptors, behind the same queries.
MMA_LAYOUTS: tuple[str, ...] = tuple(FRAGMENTS)  # what PORTAKERN_MMA_LAYOUT may name


@dataclass(frozen=True)
class Lowering:
    """What a kernel that uses the fragment API is rendered with on one target: the lane map
    (``fragment``) and whether the target runs it natively or emulates it."""

    fragment: Fragment
    native: bool

    @property
    def key(self) -> str:
        return f"{self.fragment.name}:{'native' if self.native else 'emulated'}"


def matrix_unit(dialect: str, arch: str | None) -> str | None:
    """The native fragment lowering a device of ``dialect`` whose arch text is ``arch``
    reaches ('sm80', 'cdna', 'rdna3', 'intel'), or None: it has no matrix unit portakern
    uses, and a kernel asking for fragments runs the emulation there."""
    d = DIALECTS[dialect]
    for pattern, name in d.matrix_units:
        if arch and re.search(pattern, arch):
            return name
    return None


def lowering(dialect: str, arch: str | None = None, layout: str | None = None) -> Lowering:
    """The fragment lowering for a device: native where ``arch`` has a matrix unit, else the
    emulation with the lane map ``layout`` (default: $PORTAKERN_MMA_LAYOUT, else sm80)."""
    unit = matrix_unit(dialect, arch)
    if unit is not None and dialect in FRAGMENTS[unit].native:
        return Lowering(FRAGMENTS[unit], True)
    if layout is None:
        from . import settings

        layout = settings.mma.layout
    return Lowering(FRAGMENTS[layout], False)


def _fragment_block(d: Dialect, low: Lowering, slots: Mapping[str, object]) -> str:
    f = low.fragment
    lines = [
        f"/* fragment API: {f.name} lane map, "
        f"{'native' if low.native else 'emulated through local memory'} */",
        f"#define PK_LOCAL_PTR {d.local_ptr}",
        f"#define PK_MMA_NATIVE {int(low.native)}",
        f"#define PK_MMA_WAVE {f.wave}",
        f"#define PK_MMA_A_ELEMS {f.a_elems}",
        f"#define PK_MMA_B_ELEMS {f.b_elems}",
        f"#define PK_MMA_C_ELEMS {f.c_elems}",
    ]
    for m in ("a_row", "a_col", "b_row", "b_col", "c_row", "c_col"):
        lines.append(f"#define PK_MMA_{m.upper()}(l, i) ({getattr(f, m)})")
    lines.append(f"#define PK_MMA_A_OWNER(l) ({f.a_owner})")
    lines.append(f"#define PK_MMA_B_OWNER(l) ({f.b_owner})")
    attr = f.kernel_attr.get(d.name, "") if low.native else ""
    lines.append(f"#define PK_MMA_KERNEL_ATTR {attr}")
    lines.append("typedef struct { unsigned short x[PK_MMA_A_ELEMS]; } pk_frag_a;")
    lines.append("typedef struct { unsigned short x[PK_MMA_B_ELEMS]; } pk_frag_b;")
    lines.append("typedef struct { float x[PK_MMA_C_ELEMS]; } pk_frag_c;")
    for slot, dt in slots.items():
        name = dtypes.info(dt).name
        kind = {"float16": "f16", "bfloat16": "bf16"}.get(name)
        if kind is not None:  # 16-bit slots: the tile product of their type, raw bits
            lines.append(f"#define PK_MMA_{slot} pk_mma_{kind}")
            lines.append(f"#define PK_BITS_{slot}(p, i) "
                         f"(((PK_GLOBAL const unsigned short*)(p))[i])")
    if low.native:
        lines.append(f.native[d.name].strip("\n"))
    return "\n".join(lines)


def uses_fragments(source: str) -> bool:
    """Whether a kernel source uses the fragment API (then its lowering is rendered in)."""
    return "pk_mma_" in source or "PK_MMA_" in source


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


def _builtin_lines(macro: str, params: str, template: str, fallback: str,
                   off: str = "", requires: str = "") -> list[str]:
    """#define macro(params) as the dialect's compiler builtin ``template`` where that
    compiler has it, the build does not define ``off`` (default PK_NO_<macro name>) and the
    condition ``requires`` holds (a target feature), else ``fallback``."""
    if not template:
        return [f"#define {macro}({params}) {fallback}"]
    name = template.split("(")[0]
    args = {a.strip(): f"({a.strip()})" for a in params.split(",")}
    need = f" && {requires}" if requires else ""
    return [f"#if defined(__has_builtin) && !defined({off or 'PK_NO_' + macro[3:]}){need}",
            f"#if __has_builtin({name})",
            f"#define {macro}({params}) {template.format(**args)}",
            "#endif",
            "#endif",
            f"#ifndef {macro}",
            f"#define {macro}({params}) {fallback}",
            "#endif"]


def _builtin_macros(d: Dialect) -> list[str]:
    """PK_PREFETCH(p): the dialect's hint where its compiler has it, else nothing;
    PK_PREFETCH_ONCE(p): its read-once hint, else PK_PREFETCH (off with it);
    PK_PREFETCH_OUTER(p): its outer-cache hint, else PK_PREFETCH_ONCE (off with it);
    PK_STREAM_STORE(v, p): its cache-bypassing store, else a plain store;
    PK_LOOKUP8(t, i), in dialects with vectors: its table lookup, else shuffle()."""
    lookup = _builtin_lines("PK_LOOKUP8", "t, i", d.lookup8, "shuffle(t, as_uint8(i))",
                            requires=d.lookup8_requires) if d.vectors else []
    return [*_builtin_lines("PK_PREFETCH", "p", d.prefetch, "((void)0)"),
            *_builtin_lines("PK_PREFETCH_ONCE", "p", d.prefetch_once, "PK_PREFETCH(p)",
                            off="PK_NO_PREFETCH"),
            *_builtin_lines("PK_PREFETCH_OUTER", "p", d.prefetch_outer, "PK_PREFETCH_ONCE(p)",
                            off="PK_NO_PREFETCH"),
            *_builtin_lines("PK_STREAM_STORE", "v, p", d.stream_store, "(*(p) = (v))"),
            *lookup]


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
        *_builtin_macros(d),
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
           defines: Mapping[str, object], fragments: Lowering | None = None) -> str:
    """Render a kernel source for one dialect.

    slots: dtype slot name -> dtype, e.g. {"T": float16} gives PK_T_T, PK_ACC_T,
    PK_LOAD_T(p, i), PK_STORE_T(p, i, v). defines: tunables and compile-time constants.
    fragments: the fragment API's lowering (``lowering``), rendered in when the source uses
    the API (``uses_fragments``); None: the emulation with $PORTAKERN_MMA_LAYOUT's lane map.
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
    if uses_fragments(source):
        parts.append(_fragment_block(d, fragments or lowering(dialect), slots))
    parts.append(source)
    return "\n".join(parts) + "\n"


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]

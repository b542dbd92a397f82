/* portakern roofline probes, in the same macro dialect as the op kernels, so one source
 * measures every device through that device's own compile/enqueue path.
 *
 * Both probes are written with the dialect's vector types where it has them (OpenCL
 * floatVW: PK_HAS_VECTOR), VW lanes per work-item, scalar where it has none (CUDA: VW = 1).
 * Why: a probe that leaves the vector units half empty measures half the machine. PoCL
 * vectorises a scalar work-item loop only 8 lanes wide on AVX-512 (ymm, not zmm), so the
 * scalar FMA probe reached ~220 GFLOP/s where explicit float16 reaches ~440 on the same two
 * cores, and every "% of roofline" read 1.9x too high (issue 18).
 *
 * pk_probe_copy: each work-item copies VW consecutive elements (one vector load, one vector
 *   store; consecutive work-items on consecutive addresses: coalesced on GPUs, whole cache
 *   lines on CPUs). Bytes moved: n reads + n writes of the storage type.
 * pk_probe_fma: CHAINS independent vector accumulators per work-item (enough to cover the FMA
 *   latency times the number of FMA pipes: 4-cycle latency x 2 pipes needs >= 8 on current
 *   x86), each advanced ITERS times by a fused multiply-add with runtime operands b and c (so
 *   nothing folds at compile time); ITERS and CHAINS are compile-time so the body unrolls into
 *   straight-line FMAs. FLOPs: 2 * n * CHAINS * VW * ITERS. There is no bounds test (n is a
 *   multiple of the work-group size): a conditional store can stop PoCL vectorising.
 *   acc <- acc * b + c with 0 < b < 1 converges to c / (1 - b): no overflow, no subnormals.
 *   Each lane starts from a different value, so the lanes cannot be computed once and
 *   broadcast (see the kernel).
 */
#if PK_HAS_VECTOR && VW > 1
#define PK_PV PK_CAT(PK_ACC_T, VW)
#define PK_PV_SET(s) ((PK_PV)(s))
#define PK_PV_SUM(v) pk_probe_hsum(v)
/* a*b+c, contracted to an FMA (OpenCL C contracts by default): PoCL's vector fma() builtin
 * is scalarised into VW scalar vfmadd*ss, the contracted form is one vector FMA */
#define PK_PV_FMA(a, b, c) ((a) * (b) + (c))
PK_DEVICE_FN PK_ACC_T pk_probe_hsum(PK_PV v)
{
    PK_ACC_T s = (PK_ACC_T)0;
    const PK_ACC_T* p = (const PK_ACC_T*)&v;
#pragma unroll
    for (int l = 0; l < VW; ++l) s += p[l];
    return s;
}
#else
#define PK_PV PK_ACC_T
#define PK_PV_SET(s) ((PK_ACC_T)(s))
#define PK_PV_SUM(v) (v)
#define PK_PV_FMA(a, b, c) fma(a, b, c)
#endif

PK_KERNEL void pk_probe_copy(PK_GLOBAL const PK_T_T* PK_RESTRICT X,
                             PK_GLOBAL PK_T_T* PK_RESTRICT Y, int n)
{
    const int i = PK_GROUP_ID(0) * PK_LOCAL_SIZE(0) + PK_LOCAL_ID(0);
#if PK_HAS_VECTOR && VW > 1 && PK_PLAIN_T
    /* n is a multiple of VW (probes.py): one vector load and store per work-item */
    if (i * VW < n) PK_CAT(vstore, VW)(PK_CAT(vload, VW)(i, X), i, Y);
#else
    if (i < n) PK_STORE_T(Y, i, PK_LOAD_T(X, i));
#endif
}

PK_KERNEL void pk_probe_fma(PK_GLOBAL PK_T_T* PK_RESTRICT Y, PK_ACC_T b, PK_ACC_T c)
{
    const int i = PK_GROUP_ID(0) * PK_LOCAL_SIZE(0) + PK_LOCAL_ID(0);
    const PK_PV vb = PK_PV_SET(b), vc = PK_PV_SET(c);
    PK_PV acc[CHAINS];
    /* every lane of every chain starts from its own value: with a splat start (all lanes
     * equal) splat * splat + splat is a splat, and a compiler may compute one lane and
     * broadcast it (Intel's OpenCL runtime does: 307 GFLOP/s "measured" on two Zen cores
     * whose peak is ~96), crediting VW lanes for one. The per-lane offsets are built once,
     * through memory, so the chains themselves stay in registers. */
    PK_ACC_T ramp_l[sizeof(PK_PV) / sizeof(PK_ACC_T)];
#pragma unroll
    for (int l = 0; l < (int)(sizeof(PK_PV) / sizeof(PK_ACC_T)); ++l)
        ramp_l[l] = (PK_ACC_T)l * (PK_ACC_T)1e-3;
    const PK_PV ramp = *(const PK_PV*)ramp_l;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) acc[j] = PK_PV_SET(((i & 1023) + j) * (PK_ACC_T)1e-4) + ramp;
#pragma unroll
    for (int t = 0; t < ITERS; ++t) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) acc[j] = PK_PV_FMA(acc[j], vb, vc);
    }
    PK_PV s = PK_PV_SET(0);
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) s += acc[j];
    PK_STORE_T(Y, i, PK_PV_SUM(s));  /* no bounds test: the launch covers Y exactly */
}

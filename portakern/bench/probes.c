/* portakern roofline probes, in the same macro dialect as the op kernels, so one source
 * measures every device through that device's own compile/enqueue path.
 *
 * pk_probe_copy: Y[i] = X[i], one element per work-item, consecutive work-items on
 *   consecutive addresses (coalesced on GPUs; PoCL vectorises the work-item loop on CPUs).
 *   Bytes moved: n reads + n writes of the storage type.
 * pk_probe_fma: CHAINS independent accumulators per work-item, each advanced ITERS times by
 *   a fused multiply-add with runtime operands b and c (so nothing folds at compile time);
 *   ITERS and CHAINS are compile-time so the body unrolls into straight-line FMAs (PoCL then
 *   vectorises across work-items; GPUs hide FMA latency with CHAINS-way ILP plus occupancy).
 *   The sum is stored so the work is not dead. FLOPs: 2 * n * CHAINS * ITERS. There is no
 *   bounds test (n is a multiple of the work-group size): a conditional store stops PoCL from
 *   vectorising the work-item loop and halves-to-quarters the measured peak.
 *   acc <- acc * b + c with 0 < b < 1 converges to c / (1 - b): no overflow, no subnormals.
 */
PK_KERNEL void pk_probe_copy(PK_GLOBAL const PK_T_T* PK_RESTRICT X,
                             PK_GLOBAL PK_T_T* PK_RESTRICT Y, int n)
{
    const int i = PK_GROUP_ID(0) * PK_LOCAL_SIZE(0) + PK_LOCAL_ID(0);
    if (i < n) PK_STORE_T(Y, i, PK_LOAD_T(X, i));
}

PK_KERNEL void pk_probe_fma(PK_GLOBAL PK_T_T* PK_RESTRICT Y, PK_ACC_T b, PK_ACC_T c)
{
    const int i = PK_GROUP_ID(0) * PK_LOCAL_SIZE(0) + PK_LOCAL_ID(0);
    PK_ACC_T acc[CHAINS];
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) acc[j] = (PK_ACC_T)((i & 1023) + j) * (PK_ACC_T)1e-4;
#pragma unroll
    for (int t = 0; t < ITERS; ++t) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) acc[j] = fma(acc[j], b, c);
    }
    PK_ACC_T s = (PK_ACC_T)0;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) s += acc[j];
    PK_STORE_T(Y, i, s);  /* no bounds test: the launch covers Y exactly (probes.py) */
}

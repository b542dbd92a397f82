/* The fragment API (docs/fragments.md): one 16x16x16 matrix tile owned by one wave.
 *
 * A (16x16, fp16 or bf16), B (16x16, same type) and C (16x16, fp32) are spread over the
 * PK_MMA_WAVE lanes of a wave: lane l holds PK_MMA_{A,B,C}_ELEMS elements of each, element i
 * at row PK_MMA_X_ROW(l, i), column PK_MMA_X_COL(l, i) of its tile. Where that is, is the
 * target's business: the renderer (portakern/core/codegen.py, FRAGMENTS) defines the lane
 * map, the fragment types pk_frag_{a,b,c} (16-bit patterns in A and B, floats in C) and, on
 * a target with matrix units, the native tile product pk_mma_native_{f16,bf16}. A kernel
 * addresses fragments only through the queries and the functions below, never by assuming
 * a layout: PORTAKERN_MMA_LAYOUT runs the emulation with each vendor's map, so the CPU suite
 * catches a kernel that assumes one.
 *
 * Rules (the same on every target):
 *  - lanes: lane = PK_MMA_LANE(tid), wave = PK_MMA_WAVE_ID(tid), tid the flat id within a
 *    work-group whose size is a multiple of PK_MMA_WAVE (dimension 0 fastest);
 *  - pk_mma_* products and row reductions are called by every work-item of the group the
 *    same number of times (uniform control flow: the emulation synchronises the group, a
 *    native instruction the wave);
 *  - scratch: a kernel that multiplies declares PK_MMA_SCRATCH(name, waves) at its top
 *    (local memory the emulation exchanges A and B through; one element where native), one
 *    that reduces rows PK_MMA_REDUCE_SCRATCH(name, waves); wave w passes
 *    name + w * PK_MMA_SCRATCH_WORDS (PK_MMA_REDUCE_WORDS).
 *
 * The emulation (PK_MMA_NATIVE == 0: PoCL, Intel's CPU runtime, Oclgrind, any device
 * without a matrix unit): each lane writes the A and B elements it holds to local memory,
 * the group synchronises, each lane computes its C elements as 16 fp32 multiply-adds in k
 * order (c += a_k b_k, k = 0..15), and the group synchronises again before the scratch is
 * reused. fp32 accumulation, as on every matrix unit.
 */
#define PK_MMA_WAVE_ID(tid) ((tid) / PK_MMA_WAVE)
/* (no `%` beside the `/`: LLVM pairs them behind a `freeze` Oclgrind 21.10 cannot run) */
#define PK_MMA_LANE(tid) ((tid) - PK_MMA_WAVE_ID(tid) * PK_MMA_WAVE)

#if PK_MMA_NATIVE
#define PK_MMA_SCRATCH_WORDS 1
#else
#define PK_MMA_SCRATCH_WORDS 512 /* A then B, 16x16 16-bit patterns each */
#endif
#define PK_MMA_REDUCE_WORDS 256 /* one 16x16 fp32 tile */
#define PK_MMA_SCRATCH(name, waves) PK_LOCAL unsigned short name[(waves) * PK_MMA_SCRATCH_WORDS]
#define PK_MMA_REDUCE_SCRATCH(name, waves) PK_LOCAL float name[(waves) * PK_MMA_REDUCE_WORDS]

/* fp16 bit pattern -> float, exactly (subnormals, infinities and NaN included) */
PK_DEVICE_FN float pk_f16_bits_to_float(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    const unsigned int e = ((unsigned int)h >> 10) & 0x1fu;
    const unsigned int m = (unsigned int)h & 0x3ffu;
    if (e == 0x1fu) return PK_AS_FLOAT(sign | 0x7f800000u | (m << 13));
    if (e != 0u) return PK_AS_FLOAT(sign | ((e + 112u) << 23) | (m << 13));
    const float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24: exact */
    return sign ? -v : v;
}

PK_DEVICE_FN float pk_mma_bits_to_float(unsigned short x, int bf16) {
    return bf16 ? pk_bf16_to_float(x) : pk_f16_bits_to_float(x);
}

PK_DEVICE_FN void pk_mma_fill_c(pk_frag_c* c, float v) {
    for (int i = 0; i < PK_MMA_C_ELEMS; ++i) c->x[i] = v;
}

/* A[r][k] at p[r * rs + k * cs] (16-bit patterns in local memory) */
PK_DEVICE_FN void pk_mma_load_a(pk_frag_a* a, PK_LOCAL_PTR const unsigned short* p,
                                int rs, int cs, int lane) {
    for (int i = 0; i < PK_MMA_A_ELEMS; ++i)
        a->x[i] = p[PK_MMA_A_ROW(lane, i) * rs + PK_MMA_A_COL(lane, i) * cs];
}

/* B[k][n] at p[k * rs + n * cs] */
PK_DEVICE_FN void pk_mma_load_b(pk_frag_b* b, PK_LOCAL_PTR const unsigned short* p,
                                int rs, int cs, int lane) {
    for (int i = 0; i < PK_MMA_B_ELEMS; ++i)
        b->x[i] = p[PK_MMA_B_ROW(lane, i) * rs + PK_MMA_B_COL(lane, i) * cs];
}

/* C[r][n] to p[r * rs + n * cs] (local memory) */
PK_DEVICE_FN void pk_mma_store_c(const pk_frag_c* c, PK_LOCAL_PTR float* p, int rs, int cs,
                                 int lane) {
    for (int i = 0; i < PK_MMA_C_ELEMS; ++i)
        p[PK_MMA_C_ROW(lane, i) * rs + PK_MMA_C_COL(lane, i) * cs] = c->x[i];
}

#if !PK_MMA_NATIVE
PK_DEVICE_FN void pk_mma_emulated(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b,
                                  PK_LOCAL_PTR unsigned short* s, int lane, int bf16) {
    /* (the owner tests stay outside the loops: a loop-invariant branch inside one is
     * unswitched by LLVM behind a `freeze`, which Oclgrind 21.10 cannot simulate) */
    if (PK_MMA_A_OWNER(lane))
        for (int i = 0; i < PK_MMA_A_ELEMS; ++i)
            s[PK_MMA_A_ROW(lane, i) * 16 + PK_MMA_A_COL(lane, i)] = a->x[i];
    if (PK_MMA_B_OWNER(lane))
        for (int i = 0; i < PK_MMA_B_ELEMS; ++i)
            s[256 + PK_MMA_B_ROW(lane, i) * 16 + PK_MMA_B_COL(lane, i)] = b->x[i];
    PK_BARRIER();
    for (int i = 0; i < PK_MMA_C_ELEMS; ++i) {
        const int r = PK_MMA_C_ROW(lane, i), n = PK_MMA_C_COL(lane, i);
        float acc = c->x[i];
        for (int k = 0; k < 16; ++k)
            acc += pk_mma_bits_to_float(s[r * 16 + k], bf16)
                   * pk_mma_bits_to_float(s[256 + k * 16 + n], bf16);
        c->x[i] = acc;
    }
    PK_BARRIER();
}
#endif

/* C += A B for one tile; s: this wave's PK_MMA_SCRATCH part */
PK_DEVICE_FN void pk_mma_f16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b,
                             PK_LOCAL_PTR unsigned short* s, int lane) {
#if PK_MMA_NATIVE
    pk_mma_native_f16(c, a, b);
#else
    pk_mma_emulated(c, a, b, s, lane, 0);
#endif
}

PK_DEVICE_FN void pk_mma_bf16(pk_frag_c* c, const pk_frag_a* a, const pk_frag_b* b,
                              PK_LOCAL_PTR unsigned short* s, int lane) {
#if PK_MMA_NATIVE
    pk_mma_native_bf16(c, a, b);
#else
    pk_mma_emulated(c, a, b, s, lane, 1);
#endif
}

/* Row reductions over the lanes that share a C row: out->x[i] = the sum (max) of the 16
 * elements of element i's row, added (compared) in column order 0..15 on every target, so
 * the result does not depend on the lane map. s: this wave's PK_MMA_REDUCE_SCRATCH part. */
PK_DEVICE_FN void pk_mma_row_reduce(const pk_frag_c* c, pk_frag_c* out,
                                    PK_LOCAL_PTR float* s, int lane, int is_max) {
    pk_mma_store_c(c, s, 16, 1, lane);
    PK_BARRIER();
    for (int i = 0; i < PK_MMA_C_ELEMS; ++i) {
        const int r = PK_MMA_C_ROW(lane, i);
        float v = s[r * 16];
        if (is_max)
            for (int n = 1; n < 16; ++n) v = s[r * 16 + n] > v ? s[r * 16 + n] : v;
        else
            for (int n = 1; n < 16; ++n) v += s[r * 16 + n];
        out->x[i] = v;
    }
    PK_BARRIER();
}

PK_DEVICE_FN void pk_mma_row_sum(const pk_frag_c* c, pk_frag_c* out, PK_LOCAL_PTR float* s,
                                 int lane) {
    pk_mma_row_reduce(c, out, s, lane, 0);
}

PK_DEVICE_FN void pk_mma_row_max(const pk_frag_c* c, pk_frag_c* out, PK_LOCAL_PTR float* s,
                                 int lane) {
    pk_mma_row_reduce(c, out, s, lane, 1);
}

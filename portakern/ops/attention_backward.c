/* The fused attention backward (FlashAttention-2): dQ, dK, dV from dO, the forward's inputs,
 * its output O and its log-sum-exp LSE, with no Sq x Sk buffer. Three kernels:
 *
 *   attention_bwd_delta  one item per query row: DELTA_i = sum_e dO_ie O_ie;
 *   attention_bwd_dkdv   one item per key row j of a kv head: loops over the query heads of
 *                        its group (grouped-query attention: the group's sum happens here,
 *                        K and V are never repeated) and their rows, recomputing
 *                        P_ij = exp(s_ij - LSE_i); dV_j = sum P_ij dO_i,
 *                        dK_j = scale sum dS_ij Q_i;
 *   attention_bwd_dq     one item per query row: loops over the keys;
 *                        dQ_i = scale sum_j dS_ij K_j,
 *
 * with s_ij = (scale Q_i) . K_j exactly as the forward scores it (the scale folded into q
 * first), dP_ij = dO_i . V_j and dS_ij = P_ij (dP_ij - DELTA_i). No atomics: every output
 * element has one writer, so results are the same bits run to run. Keys a row does not attend
 * (causal: j > i, top-left aligned as the forward; MASK, broadcast strides ms0..ms3; a
 * window (AB_WIN, this op's compile-time switch, the backward taking no score modifier;
 * attention_mods.c's at_in_window, wl, wr) as the forward's) have
 * P = 0, and so does every key of a dead row (LSE = -inf): its gradient is 0.
 * Layouts (contiguous): Q, dO, O, dQ (B, Hq, Sq, D or DV); K, V, dK, dV (B, Hkv, Sk, D or DV);
 * LSE, DELTA (B, Hq, Sq) in the compute type. Accumulation in the compute type (PK_ACC_T).
 */
#define DQ_ (DQ > 0 ? DQ : 1)
#define DV_ (DV > 0 ? DV : 1)

PK_KERNEL void attention_bwd_delta(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                   PK_GLOBAL const PK_T_T* PK_RESTRICT O,
                                   PK_GLOBAL PK_ACC_T* PK_RESTRICT DELTA, int rows)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0);
    if (r >= rows) return;
    PK_ACC_T acc = (PK_ACC_T)0;
    for (int e = 0; e < DV; ++e) acc += PK_LOAD_T(DO, r * DV + e) * PK_LOAD_T(O, r * DV + e);
    DELTA[r] = acc;
}

/* whether query row i of (b, h) attends key j */
PK_DEVICE_FN int ab_keep(PK_GLOBAL const unsigned char* PK_RESTRICT MASK, int b, int h, int i,
                         int j, int causal, int has_mask, int ms0, int ms1, int ms2, int ms3,
                         int wl, int wr)
{
    if (causal && j > i) return 0;
    if (AB_WIN && !at_in_window(i, j, wl, wr)) return 0;
    return !has_mask || MASK[b * ms0 + h * ms1 + i * ms2 + j * ms3] != 0;
}

/* the scalar path's dK/dV of key row r = (b, kv head, j) */
PK_DEVICE_FN void ab_dkdv_row(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                              PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                              PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                              PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                              PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                              PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                              PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                              PK_GLOBAL PK_T_T* PK_RESTRICT DK,
                              PK_GLOBAL PK_T_T* PK_RESTRICT DVO,
                              int Sq, int Sk, int Hq, int group, int r, PK_ACC_T scale,
                              int causal, int has_mask, int ms0, int ms1, int ms2, int ms3,
                         int wl, int wr)
{
    const int Hkv = Hq / group;
    const int bkv = r / Sk;
    const int j = r - bkv * Sk;
    const int b = bkv / Hkv;
    const int kvh = bkv - b * Hkv;
    /* Registers hold only the dK and dV accumulators (fully unrolled: DQ and DV are
     * compile-time constants); the key's own K and V rows are re-read from the cache, so a
     * GPU item fits its register budget without spilling (`portakern resources`). */
    PK_ACC_T dk[DQ_], dv[DV_];
    #pragma unroll
    for (int d = 0; d < DQ_; ++d) dk[d] = (PK_ACC_T)0;
    #pragma unroll
    for (int e = 0; e < DV_; ++e) dv[e] = (PK_ACC_T)0;
    for (int hh = 0; hh < group; ++hh) {
        const int h = kvh * group + hh;
        const int bh = b * Hq + h;
        for (int i = causal ? j : 0; i < Sq; ++i) {
            if (!ab_keep(MASK, b, h, i, j, causal, has_mask, ms0, ms1, ms2, ms3, wl, wr)) continue;
            const PK_ACC_T lse = LSE[bh * Sq + i];
            if (lse == -PK_INFINITY) continue; /* a dead row: P = 0 */
            const int qrow = (bh * Sq + i);
            PK_ACC_T s = (PK_ACC_T)0, dp = (PK_ACC_T)0;
            #pragma unroll 8
            for (int d = 0; d < DQ; ++d)
                s += (scale * PK_LOAD_T(Q, qrow * DQ + d)) * PK_LOAD_T(K, r * DQ + d);
            #pragma unroll 8
            for (int e = 0; e < DV; ++e)
                dp += PK_LOAD_T(DO, qrow * DV + e) * PK_LOAD_T(V, r * DV + e);
            const PK_ACC_T p = exp(s - lse);
            const PK_ACC_T ds = p * (dp - DELTA[qrow]);
            #pragma unroll
            for (int e = 0; e < DV; ++e) dv[e] += p * PK_LOAD_T(DO, qrow * DV + e);
            #pragma unroll
            for (int d = 0; d < DQ; ++d) dk[d] += ds * PK_LOAD_T(Q, qrow * DQ + d);
        }
    }
    #pragma unroll
    for (int d = 0; d < DQ; ++d) PK_STORE_T(DK, r * DQ + d, dk[d] * scale);
    #pragma unroll
    for (int e = 0; e < DV; ++e) PK_STORE_T(DVO, r * DV + e, dv[e]);
}

/* the scalar path's dQ of query row r = (b, h, i) */
PK_DEVICE_FN void ab_dq_row(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                            PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                            PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                            PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                            PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                            PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                            PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                            PK_GLOBAL PK_T_T* PK_RESTRICT DQO,
                            int Sq, int Sk, int Hq, int group, int r, PK_ACC_T scale,
                            int causal, int has_mask, int ms0, int ms1, int ms2, int ms3,
                         int wl, int wr)
{
    const int bh = r / Sq;
    const int i = r - bh * Sq;
    const int b = bh / Hq;
    const int h = bh - b * Hq;
    const int kvrow0 = (b * (Hq / group) + h / group) * Sk;
    /* Registers hold only the dQ accumulators; q (scaled as the forward scales it) and dO
     * are re-read from the cache per key (see ab_dkdv_row). */
    PK_ACC_T dq[DQ_];
    #pragma unroll
    for (int d = 0; d < DQ_; ++d) dq[d] = (PK_ACC_T)0;
    const PK_ACC_T lse = LSE[r];
    const PK_ACC_T delta = DELTA[r];
    const int jend = causal ? min(i + 1, Sk) : Sk;
    if (lse != -PK_INFINITY) { /* a dead row keeps dQ = 0 */
        for (int j = 0; j < jend; ++j) {
            if (!ab_keep(MASK, b, h, i, j, causal, has_mask, ms0, ms1, ms2, ms3, wl, wr)) continue;
            const int kr = kvrow0 + j;
            PK_ACC_T s = (PK_ACC_T)0, dp = (PK_ACC_T)0;
            #pragma unroll 8
            for (int d = 0; d < DQ; ++d)
                s += (scale * PK_LOAD_T(Q, r * DQ + d)) * PK_LOAD_T(K, kr * DQ + d);
            #pragma unroll 8
            for (int e = 0; e < DV; ++e)
                dp += PK_LOAD_T(DO, r * DV + e) * PK_LOAD_T(V, kr * DV + e);
            const PK_ACC_T ds = exp(s - lse) * (dp - delta);
            #pragma unroll
            for (int d = 0; d < DQ; ++d) dq[d] += ds * PK_LOAD_T(K, kr * DQ + d);
        }
    }
    #pragma unroll
    for (int d = 0; d < DQ; ++d) PK_STORE_T(DQO, r * DQ + d, dq[d] * scale);
}

PK_KERNEL PK_LAUNCH_BOUNDS(WG, 1) void attention_bwd_dkdv(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                  PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                  PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                  PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                  PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                  PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                  PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                                  PK_GLOBAL PK_T_T* PK_RESTRICT DK,
                                  PK_GLOBAL PK_T_T* PK_RESTRICT DVO,
                                  int Sq, int Sk, int Hq, int group, int rows, PK_ACC_T scale,
                                  int causal, int has_mask, int ms0, int ms1, int ms2, int ms3,
                         int wl, int wr)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0); /* (b, kv head, j) */
    if (r >= rows) return;
    ab_dkdv_row(DO, Q, K, V, LSE, DELTA, MASK, DK, DVO, Sq, Sk, Hq, group, r, scale, causal,
                has_mask, ms0, ms1, ms2, ms3, wl, wr);
}

PK_KERNEL PK_LAUNCH_BOUNDS(WG, 1) void attention_bwd_dq(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                                PK_GLOBAL PK_T_T* PK_RESTRICT DQO,
                                int Sq, int Sk, int Hq, int group, int rows, PK_ACC_T scale,
                                int causal, int has_mask, int ms0, int ms1, int ms2, int ms3,
                         int wl, int wr)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0); /* (b, h, i) */
    if (r >= rows) return;
    ab_dq_row(DO, Q, K, V, LSE, DELTA, MASK, DQO, Sq, Sk, Hq, group, r, scale, causal, has_mask,
              ms0, ms1, ms2, ms3, wl, wr);
}

/* ---- The CPU vector path (AB_VEC: OpenCL vectors, storage type = compute type) ----------
 * Five kernels: delta (above), two pack kernels, dK/dV and dQ. The packs copy, once, with
 * zero padding to Skp / Sqp (multiples of BLK = NV * VEC):
 *   KT: per kv head and block of BLK keys, DQ rows of BLK: K[kvh][j][d] at
 *       (kvh * Skp + j0) * DQ + d * BLK + (j - j0), j0 = j's block start (VT alike, DV rows);
 *   QT (scale Q) and DOT (dO): per query head and block of BLK queries, the same way;
 *   (a block's rows contiguous: rows Skp words apart would share the few cache sets),
 *   LSEP[bh * Sqp + i] = LSE (+inf for a dead row and the padding: exp(s - inf) = 0, no NaN),
 *   DELTAP[bh * Sqp + i] = DELTA (0 past Sq).
 * dQ: one item = TQ query rows of one head; keys in blocks of BLK, VEC keys per vector: s and
 * dP from KT/VT rows, P = exp(s - lse) (the vector exp), dS = P (dP - delta); then
 * dQ += dS_j K_j as DQ / VEC vector FMAs per key (K rows read in place), each K row used by
 * the TQ rows. dK/dV: one item = TK key rows of one kv head; the group's query heads and
 * their rows in blocks of BLK, VEC queries per vector, from QT/DOT/LSEP/DELTAP; then
 * dV += P_i dO_i and dK += dS_i Q_i, vectors over e and d. Blocks that a mask, the causal
 * diagonal or the edge of Sk cuts are corrected lane by lane through memory (P = dS = 0 on
 * keys not attended). Python picks VEC dividing D and DV (ab_vec in attention_backward.py). */
#define AB_VEC (VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T)
#define BLK (NV * VEC)
#if AB_VEC
typedef PK_CAT(PK_ACC_T, VEC) ab_vt;
#define AB_VLOAD(c, p) PK_CAT(vload, VEC)(c, p)
#define AB_VSTORE(x, c, p) PK_CAT(vstore, VEC)(x, c, p)
#define NDQ (DQ_ / VEC)
#define NDV (DV_ / VEC)
#endif

PK_KERNEL void attention_bwd_pack_kv(PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                     PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                     PK_GLOBAL PK_ACC_T* PK_RESTRICT KT,
                                     PK_GLOBAL PK_ACC_T* PK_RESTRICT VT,
                                     int Sk, int Skp, int rows)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0); /* (b, kv head, j < Skp) */
    if (r >= rows) return;
    const int kvh = r / Skp;
    const int j = r - kvh * Skp;
    const int ok = j < Sk;
    const int jb = r - j % BLK; /* the block's first key, counted over heads */
    for (int d = 0; d < DQ; ++d)
        KT[jb * DQ + d * BLK + j % BLK] = ok ? PK_LOAD_T(K, (kvh * Sk + j) * DQ + d)
                                             : (PK_ACC_T)0;
    for (int e = 0; e < DV; ++e)
        VT[jb * DV + e * BLK + j % BLK] = ok ? PK_LOAD_T(V, (kvh * Sk + j) * DV + e)
                                             : (PK_ACC_T)0;
}

PK_KERNEL void attention_bwd_pack_q(PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                    PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                    PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                    PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                    PK_GLOBAL PK_ACC_T* PK_RESTRICT QT,
                                    PK_GLOBAL PK_ACC_T* PK_RESTRICT DOT,
                                    PK_GLOBAL PK_ACC_T* PK_RESTRICT LSEP,
                                    PK_GLOBAL PK_ACC_T* PK_RESTRICT DELTAP,
                                    int Sq, int Sqp, int rows, PK_ACC_T scale)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0); /* (b, h, i < Sqp) */
    if (r >= rows) return;
    const int bh = r / Sqp;
    const int i = r - bh * Sqp;
    const int ok = i < Sq;
    const int qrow = bh * Sq + i;
    const int ib = r - i % BLK; /* the block's first query, counted over heads */
    for (int d = 0; d < DQ; ++d)
        QT[ib * DQ + d * BLK + i % BLK] = ok ? scale * PK_LOAD_T(Q, qrow * DQ + d)
                                             : (PK_ACC_T)0;
    for (int e = 0; e < DV; ++e)
        DOT[ib * DV + e * BLK + i % BLK] = ok ? PK_LOAD_T(DO, qrow * DV + e) : (PK_ACC_T)0;
    const PK_ACC_T lse = ok ? LSE[qrow] : -PK_INFINITY;
    LSEP[r] = (lse == -PK_INFINITY) ? (PK_ACC_T)PK_INFINITY : lse;
    DELTAP[r] = ok ? DELTA[qrow] : (PK_ACC_T)0;
}

PK_KERNEL void attention_bwd_dkdv_vec(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                      PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                      PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                      PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                      PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                      PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                      PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                                      PK_GLOBAL PK_T_T* PK_RESTRICT DK,
                                      PK_GLOBAL PK_T_T* PK_RESTRICT DVO,
                                      PK_GLOBAL const PK_ACC_T* PK_RESTRICT QT,
                                      PK_GLOBAL const PK_ACC_T* PK_RESTRICT DOT,
                                      PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSEP,
                                      PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTAP,
                                      int Sq, int Sk, int Hq, int group, int nkb, int items,
                                      PK_ACC_T scale, int causal, int has_mask, int ms0, int ms1,
                                      int ms2, int ms3, int Sqp, int wl, int wr)
{
    const int it = PK_GROUP_ID(0); /* (b, kv head, block of TK keys) */
    if (it >= items) return;
    const int bkv = it / nkb;
    const int j0 = (it - bkv * nkb) * TK;
#if !AB_VEC
    /* a dialect without vectors: the scalar path, key by key */
    for (int t = 0; t < TK; ++t)
        if (j0 + t < Sk)
            ab_dkdv_row(DO, Q, K, V, LSE, DELTA, MASK, DK, DVO, Sq, Sk, Hq, group,
                        bkv * Sk + j0 + t, scale, causal, has_mask, ms0, ms1, ms2, ms3, wl, wr);
#else
    const int Hkv = Hq / group;
    const int b = bkv / Hkv;
    const int kvh = bkv - b * Hkv;
    PK_ACC_T kr[TK][DQ_], vr[TK][DV_];
    ab_vt dk[TK][NDQ], dv[TK][NDV];
    for (int t = 0; t < TK; ++t) {
        const int row = bkv * Sk + min(j0 + t, Sk - 1);
        for (int d = 0; d < DQ; ++d) kr[t][d] = PK_LOAD_T(K, row * DQ + d);
        for (int e = 0; e < DV; ++e) vr[t][e] = PK_LOAD_T(V, row * DV + e);
        #pragma unroll
        for (int c = 0; c < NDQ; ++c) dk[t][c] = (ab_vt)(0);
        #pragma unroll
        for (int c = 0; c < NDV; ++c) dv[t][c] = (ab_vt)(0);
    }
    for (int hh = 0; hh < group; ++hh) {
        const int h = kvh * group + hh;
        const int bh = b * Hq + h;
        const int ibeg = causal ? (j0 / BLK) * BLK : 0;
        for (int i0 = ibeg; i0 < Sq; i0 += BLK) {
            const PK_GLOBAL PK_ACC_T* qt = QT + (bh * Sqp + i0) * DQ;
            const PK_GLOBAL PK_ACC_T* dot = DOT + (bh * Sqp + i0) * DV;
            ab_vt sv[TK][NV], dpv[TK][NV];
            #pragma unroll
            for (int t = 0; t < TK; ++t)
                #pragma unroll
                for (int c = 0; c < NV; ++c) { sv[t][c] = (ab_vt)(0); dpv[t][c] = (ab_vt)(0); }
            for (int d = 0; d < DQ; ++d) {
                ab_vt x[NV];
                #pragma unroll
                for (int c = 0; c < NV; ++c) x[c] = AB_VLOAD(c, qt + d * BLK);
                #pragma unroll
                for (int t = 0; t < TK; ++t)
                    #pragma unroll
                    for (int c = 0; c < NV; ++c) sv[t][c] = fma((ab_vt)(kr[t][d]), x[c], sv[t][c]);
            }
            for (int e = 0; e < DV; ++e) {
                ab_vt x[NV];
                #pragma unroll
                for (int c = 0; c < NV; ++c) x[c] = AB_VLOAD(c, dot + e * BLK);
                #pragma unroll
                for (int t = 0; t < TK; ++t)
                    #pragma unroll
                    for (int c = 0; c < NV; ++c)
                        dpv[t][c] = fma((ab_vt)(vr[t][e]), x[c], dpv[t][c]);
            }
            PK_ACC_T pt[TK][BLK], dst[TK][BLK];
            #pragma unroll
            for (int c = 0; c < NV; ++c) {
                const ab_vt lv = AB_VLOAD(c, LSEP + bh * Sqp + i0);
                const ab_vt dl = AB_VLOAD(c, DELTAP + bh * Sqp + i0);
                #pragma unroll
                for (int t = 0; t < TK; ++t) {
                    const ab_vt p = PK_VEXP(sv[t][c] - lv);
                    AB_VSTORE(p, c, &pt[t][0]);
                    AB_VSTORE(p * (dpv[t][c] - dl), c, &dst[t][0]);
                }
            }
            if (has_mask || (causal && i0 < j0 + TK - 1) || AB_WIN) { /* lane by lane */
                for (int t = 0; t < TK; ++t) {
                    const int jt = min(j0 + t, Sk - 1);
                    for (int c = 0; c < BLK; ++c) {
                        const int i = i0 + c;
                        int ok = i < Sq && (!causal || i >= j0 + t);
                        if (AB_WIN && !at_in_window(i, jt, wl, wr)) ok = 0;
                        if (ok && has_mask) ok = MASK[b * ms0 + h * ms1 + i * ms2 + jt * ms3] != 0;
                        if (!ok) { pt[t][c] = (PK_ACC_T)0; dst[t][c] = (PK_ACC_T)0; }
                    }
                }
            }
            const int iend = min(BLK, Sq - i0);
            for (int c = 0; c < iend; ++c) {
                const int qrow = bh * Sq + i0 + c;
                ab_vt x[NDV > NDQ ? NDV : NDQ];
                #pragma unroll
                for (int u = 0; u < NDV; ++u) x[u] = AB_VLOAD(u, DO + qrow * DV);
                #pragma unroll
                for (int t = 0; t < TK; ++t) {
                    const ab_vt pb = (ab_vt)(pt[t][c]);
                    #pragma unroll
                    for (int u = 0; u < NDV; ++u) dv[t][u] = fma(pb, x[u], dv[t][u]);
                }
                #pragma unroll
                for (int u = 0; u < NDQ; ++u) x[u] = AB_VLOAD(u, Q + qrow * DQ);
                #pragma unroll
                for (int t = 0; t < TK; ++t) {
                    const ab_vt db = (ab_vt)(dst[t][c]);
                    #pragma unroll
                    for (int u = 0; u < NDQ; ++u) dk[t][u] = fma(db, x[u], dk[t][u]);
                }
            }
        }
    }
    for (int t = 0; t < TK; ++t) {
        if (j0 + t >= Sk) continue;
        const int row = bkv * Sk + j0 + t;
        #pragma unroll
        for (int u = 0; u < NDQ; ++u) AB_VSTORE(dk[t][u] * (ab_vt)(scale), u, DK + row * DQ);
        #pragma unroll
        for (int u = 0; u < NDV; ++u) AB_VSTORE(dv[t][u], u, DVO + row * DV);
    }
#endif
}

PK_KERNEL void attention_bwd_dq_vec(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                    PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                    PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                    PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                    PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                    PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                    PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                                    PK_GLOBAL PK_T_T* PK_RESTRICT DQO,
                                    PK_GLOBAL const PK_ACC_T* PK_RESTRICT KT,
                                    PK_GLOBAL const PK_ACC_T* PK_RESTRICT VT,
                                    int Sq, int Sk, int Hq, int group, int nqb, int items,
                                    PK_ACC_T scale, int causal, int has_mask, int ms0, int ms1,
                                    int ms2, int ms3, int Skp, int wl, int wr)
{
    const int it = PK_GROUP_ID(0); /* (b, h, block of TQ queries) */
    if (it >= items) return;
    const int bh = it / nqb;
    const int i0 = (it - bh * nqb) * TQ;
#if !AB_VEC
    for (int t = 0; t < TQ; ++t)
        if (i0 + t < Sq)
            ab_dq_row(DO, Q, K, V, LSE, DELTA, MASK, DQO, Sq, Sk, Hq, group, bh * Sq + i0 + t,
                      scale, causal, has_mask, ms0, ms1, ms2, ms3, wl, wr);
#else
    const int b = bh / Hq;
    const int h = bh - b * Hq;
    const int kvb = b * (Hq / group) + h / group;
    const PK_GLOBAL PK_T_T* krow = K + kvb * Sk * DQ;
    PK_ACC_T qs[TQ][DQ_], doi[TQ][DV_], ls[TQ], dl[TQ];
    ab_vt dq[TQ][NDQ];
    for (int t = 0; t < TQ; ++t) {
        const int r = bh * Sq + min(i0 + t, Sq - 1);
        for (int d = 0; d < DQ; ++d) qs[t][d] = scale * PK_LOAD_T(Q, r * DQ + d);
        for (int e = 0; e < DV; ++e) doi[t][e] = PK_LOAD_T(DO, r * DV + e);
        const PK_ACC_T lse = LSE[r];
        /* a dead row (and a row past Sq): exp(s - inf) = 0, dQ = 0 */
        ls[t] = (lse == -PK_INFINITY || i0 + t >= Sq) ? (PK_ACC_T)PK_INFINITY : lse;
        dl[t] = DELTA[r];
        #pragma unroll
        for (int c = 0; c < NDQ; ++c) dq[t][c] = (ab_vt)(0);
    }
    const int kend = causal ? min(Sk, i0 + TQ) : Sk;
    for (int k0 = 0; k0 < kend; k0 += BLK) {
        const PK_GLOBAL PK_ACC_T* kt = KT + (kvb * Skp + k0) * DQ;
        const PK_GLOBAL PK_ACC_T* vt = VT + (kvb * Skp + k0) * DV;
        ab_vt sv[TQ][NV], dpv[TQ][NV];
        #pragma unroll
        for (int t = 0; t < TQ; ++t)
            #pragma unroll
            for (int c = 0; c < NV; ++c) { sv[t][c] = (ab_vt)(0); dpv[t][c] = (ab_vt)(0); }
        for (int d = 0; d < DQ; ++d) {
            ab_vt x[NV];
            #pragma unroll
            for (int c = 0; c < NV; ++c) x[c] = AB_VLOAD(c, kt + d * BLK);
            #pragma unroll
            for (int t = 0; t < TQ; ++t)
                #pragma unroll
                for (int c = 0; c < NV; ++c) sv[t][c] = fma((ab_vt)(qs[t][d]), x[c], sv[t][c]);
        }
        for (int e = 0; e < DV; ++e) {
            ab_vt x[NV];
            #pragma unroll
            for (int c = 0; c < NV; ++c) x[c] = AB_VLOAD(c, vt + e * BLK);
            #pragma unroll
            for (int t = 0; t < TQ; ++t)
                #pragma unroll
                for (int c = 0; c < NV; ++c) dpv[t][c] = fma((ab_vt)(doi[t][e]), x[c], dpv[t][c]);
        }
        PK_ACC_T dst[TQ][BLK];
        #pragma unroll
        for (int t = 0; t < TQ; ++t)
            #pragma unroll
            for (int c = 0; c < NV; ++c) {
                const ab_vt p = PK_VEXP(sv[t][c] - (ab_vt)(ls[t]));
                AB_VSTORE(p * (dpv[t][c] - (ab_vt)(dl[t])), c, &dst[t][0]);
            }
        if (has_mask || k0 + BLK > Sk || (causal && k0 + BLK - 1 > i0) || AB_WIN) {
            /* lane by lane */
            for (int t = 0; t < TQ; ++t) {
                const int i = min(i0 + t, Sq - 1);
                for (int c = 0; c < BLK; ++c) {
                    const int j = k0 + c;
                    int ok = j < Sk && (!causal || j <= i);
                    if (AB_WIN && !at_in_window(i, j, wl, wr)) ok = 0;
                    if (ok && has_mask) ok = MASK[b * ms0 + h * ms1 + i * ms2 + j * ms3] != 0;
                    if (!ok) dst[t][c] = (PK_ACC_T)0;
                }
            }
        }
        const int jn = min(BLK, Sk - k0);
        for (int c = 0; c < jn; ++c) {
            ab_vt x[NDQ];
            #pragma unroll
            for (int u = 0; u < NDQ; ++u) x[u] = AB_VLOAD(u, krow + (k0 + c) * DQ);
            #pragma unroll
            for (int t = 0; t < TQ; ++t) {
                const ab_vt sb = (ab_vt)(dst[t][c]);
                #pragma unroll
                for (int u = 0; u < NDQ; ++u) dq[t][u] = fma(sb, x[u], dq[t][u]);
            }
        }
    }
    for (int t = 0; t < TQ; ++t) {
        if (i0 + t >= Sq) continue;
        const int r = bh * Sq + i0 + t;
        #pragma unroll
        for (int u = 0; u < NDQ; ++u) AB_VSTORE(dq[t][u] * (ab_vt)(scale), u, DQO + r * DQ);
    }
#endif
}

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
 * (causal: j > i, top-left aligned as the forward; MASK, broadcast strides ms0..ms3) have
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
                         int j, int causal, int has_mask, int ms0, int ms1, int ms2, int ms3)
{
    if (causal && j > i) return 0;
    return !has_mask || MASK[b * ms0 + h * ms1 + i * ms2 + j * ms3] != 0;
}

PK_KERNEL void attention_bwd_dkdv(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                  PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                  PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                  PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                  PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                  PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                  PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                                  PK_GLOBAL PK_T_T* PK_RESTRICT DK,
                                  PK_GLOBAL PK_T_T* PK_RESTRICT DVO,
                                  int Sq, int Sk, int Hq, int group, int rows, PK_ACC_T scale,
                                  int causal, int has_mask, int ms0, int ms1, int ms2, int ms3)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0); /* (b, kv head, j) */
    if (r >= rows) return;
    const int Hkv = Hq / group;
    const int bkv = r / Sk;
    const int j = r - bkv * Sk;
    const int b = bkv / Hkv;
    const int kvh = bkv - b * Hkv;
    PK_ACC_T kj[DQ_], vj[DV_], dk[DQ_], dv[DV_];
    for (int d = 0; d < DQ; ++d) { kj[d] = PK_LOAD_T(K, r * DQ + d); dk[d] = (PK_ACC_T)0; }
    for (int e = 0; e < DV; ++e) { vj[e] = PK_LOAD_T(V, r * DV + e); dv[e] = (PK_ACC_T)0; }
    for (int hh = 0; hh < group; ++hh) {
        const int h = kvh * group + hh;
        const int bh = b * Hq + h;
        for (int i = causal ? j : 0; i < Sq; ++i) {
            if (!ab_keep(MASK, b, h, i, j, causal, has_mask, ms0, ms1, ms2, ms3)) continue;
            const PK_ACC_T lse = LSE[bh * Sq + i];
            if (lse == -PK_INFINITY) continue; /* a dead row: P = 0 */
            const int qrow = (bh * Sq + i);
            PK_ACC_T s = (PK_ACC_T)0, dp = (PK_ACC_T)0;
            for (int d = 0; d < DQ; ++d) s += (scale * PK_LOAD_T(Q, qrow * DQ + d)) * kj[d];
            for (int e = 0; e < DV; ++e) dp += PK_LOAD_T(DO, qrow * DV + e) * vj[e];
            const PK_ACC_T p = exp(s - lse);
            const PK_ACC_T ds = p * (dp - DELTA[qrow]);
            for (int e = 0; e < DV; ++e) dv[e] += p * PK_LOAD_T(DO, qrow * DV + e);
            for (int d = 0; d < DQ; ++d) dk[d] += ds * PK_LOAD_T(Q, qrow * DQ + d);
        }
    }
    for (int d = 0; d < DQ; ++d) PK_STORE_T(DK, r * DQ + d, dk[d] * scale);
    for (int e = 0; e < DV; ++e) PK_STORE_T(DVO, r * DV + e, dv[e]);
}

PK_KERNEL void attention_bwd_dq(PK_GLOBAL const PK_T_T* PK_RESTRICT DO,
                                PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                                PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                PK_GLOBAL const PK_ACC_T* PK_RESTRICT LSE,
                                PK_GLOBAL const PK_ACC_T* PK_RESTRICT DELTA,
                                PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                                PK_GLOBAL PK_T_T* PK_RESTRICT DQO,
                                int Sq, int Sk, int Hq, int group, int rows, PK_ACC_T scale,
                                int causal, int has_mask, int ms0, int ms1, int ms2, int ms3)
{
    const int r = PK_GROUP_ID(0) * WG + PK_LOCAL_ID(0); /* (b, h, i) */
    if (r >= rows) return;
    const int bh = r / Sq;
    const int i = r - bh * Sq;
    const int b = bh / Hq;
    const int h = bh - b * Hq;
    const int kvrow0 = (b * (Hq / group) + h / group) * Sk;
    PK_ACC_T qs[DQ_], doi[DV_], dq[DQ_];
    for (int d = 0; d < DQ; ++d) { qs[d] = scale * PK_LOAD_T(Q, r * DQ + d); dq[d] = (PK_ACC_T)0; }
    for (int e = 0; e < DV; ++e) doi[e] = PK_LOAD_T(DO, r * DV + e);
    const PK_ACC_T lse = LSE[r];
    const PK_ACC_T delta = DELTA[r];
    const int jend = causal ? min(i + 1, Sk) : Sk;
    if (lse != -PK_INFINITY) { /* a dead row keeps dQ = 0 */
        for (int j = 0; j < jend; ++j) {
            if (!ab_keep(MASK, b, h, i, j, causal, has_mask, ms0, ms1, ms2, ms3)) continue;
            const int kr = kvrow0 + j;
            PK_ACC_T s = (PK_ACC_T)0, dp = (PK_ACC_T)0;
            for (int d = 0; d < DQ; ++d) s += qs[d] * PK_LOAD_T(K, kr * DQ + d);
            for (int e = 0; e < DV; ++e) dp += doi[e] * PK_LOAD_T(V, kr * DV + e);
            const PK_ACC_T ds = exp(s - lse) * (dp - delta);
            for (int d = 0; d < DQ; ++d) dq[d] += ds * PK_LOAD_T(K, kr * DQ + d);
        }
    }
    for (int d = 0; d < DQ; ++d) PK_STORE_T(DQO, r * DQ + d, dq[d] * scale);
}

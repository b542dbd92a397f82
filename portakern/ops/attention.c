/* O = softmax(scale * Q K^T  [causal, mask]) V, fused: the Sq x Sk scores never leave the chip.
 *
 * Layouts (contiguous): Q (B, Hq, Sq, D), K (B, Hkv, Sk, D), V (B, Hkv, Sk, DV), O (B, Hq, Sq, DV);
 * MASK: bytes (1 = attend) addressed with broadcast strides ms0..ms3 (0 on broadcast dims).
 * Grouped-query attention: query head h reads kv head h / group.
 *
 * One work-group = BQ queries of one (batch, head); one work-item = one query row, whose q,
 * output accumulator and running (max m, sum l) live in registers. Key/value tiles of BK rows
 * are staged in local memory and shared by the group. Online softmax per tile
 * (FlashAttention): scores of the tile -> tile max -> one rescale of (l, acc) -> accumulate.
 * Causal: tiles wholly after the group's last query are never loaded. A row with no key to
 * attend (fully masked, or Sk = 0) writes 0.
 */
#define DQ_ (DQ > 0 ? DQ : 1)
#define DV_ (DV > 0 ? DV : 1)

PK_KERNEL void attention(PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                         PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                         PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                         PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                         PK_GLOBAL PK_T_T* PK_RESTRICT O,
                         int Sq, int Sk, int Hq, int group, int nqb, PK_ACC_T scale,
                         int causal, int has_mask, int ms0, int ms1, int ms2, int ms3)
{
    const int g = PK_GROUP_ID(0);
    const int bh = g / nqb;
    const int qb = g - bh * nqb;
    const int b = bh / Hq;
    const int h = bh - b * Hq;
    const int Hkv = Hq / group;
    const int kvrow0 = (b * Hkv + h / group) * Sk;
    const int lid = PK_LOCAL_ID(0);
    const int qi = qb * BQ + lid;
    const int qrow = min(qi, Sq - 1);
    const int mrow = b * ms0 + h * ms1 + qrow * ms2;

    PK_LOCAL PK_ACC_T Ks[BK][DQ_];
    PK_LOCAL PK_ACC_T Vs[BK][DV_];
    PK_ACC_T qr[DQ_];
    PK_ACC_T acc[DV_];
    PK_ACC_T sc[BK];
    for (int d = 0; d < DQ; ++d) qr[d] = PK_LOAD_T(Q, (bh * Sq + qrow) * DQ + d) * scale;
    for (int d = 0; d < DV; ++d) acc[d] = (PK_ACC_T)0;
    PK_ACC_T m = -PK_INFINITY, l = (PK_ACC_T)0;

    const int kend = causal ? min(Sk, qb * BQ + BQ) : Sk;
    for (int k0 = 0; k0 < kend; k0 += BK) {
        for (int idx = lid; idx < BK * DQ; idx += BQ) {
            const int j = idx / DQ, d = idx - (idx / DQ) * DQ;
            Ks[j][d] = (k0 + j < Sk) ? PK_LOAD_T(K, (kvrow0 + k0 + j) * DQ + d) : (PK_ACC_T)0;
        }
        for (int idx = lid; idx < BK * DV; idx += BQ) {
            const int j = idx / DV, d = idx - (idx / DV) * DV;
            Vs[j][d] = (k0 + j < Sk) ? PK_LOAD_T(V, (kvrow0 + k0 + j) * DV + d) : (PK_ACC_T)0;
        }
        PK_BARRIER();

        PK_ACC_T bm = -PK_INFINITY;
        for (int j = 0; j < BK; ++j) {
            const int kj = k0 + j;
            int ok = kj < Sk && (!causal || kj <= qi);
            if (ok && has_mask) ok = MASK[mrow + kj * ms3] != 0;
            PK_ACC_T s = -PK_INFINITY;
            if (ok) {
                s = (PK_ACC_T)0;
                for (int d = 0; d < DQ; ++d) s += qr[d] * Ks[j][d];
            }
            sc[j] = s;
            bm = (s > bm || s != s) ? s : bm;
        }
        if (bm != -PK_INFINITY) {
            const PK_ACC_T mn = (bm > m || bm != bm) ? bm : m;
            const PK_ACC_T corr = exp(m - mn);
            l *= corr;
            for (int d = 0; d < DV; ++d) acc[d] *= corr;
            for (int j = 0; j < BK; ++j) {
                const PK_ACC_T p = exp(sc[j] - mn);
                l += p;
                for (int d = 0; d < DV; ++d) acc[d] += p * Vs[j][d];
            }
            m = mn;
        }
        PK_BARRIER();
    }

    if (qi < Sq) {
        const PK_ACC_T inv = (l == (PK_ACC_T)0) ? (PK_ACC_T)0 : (PK_ACC_T)1 / l;
        for (int d = 0; d < DV; ++d) PK_STORE_T(O, (bh * Sq + qi) * DV + d, acc[d] * inv);
    }
}

#if AT_MMA
/* Attention's fragment schedule (MMA=1, fp16/bf16: attention.py): Q K^T and P V on matrix
 * units through the fragment API (mma.c, docs/fragments.md); nothing here knows a lane map.
 *
 * One work-group of 64 items (64 / PK_MMA_WAVE waves) takes 16 queries of one (batch, head)
 * and walks the keys in tiles of AM_BK = 16 (one 16-key score tile per step: the K, V, S and
 * P tiles of a group fit 8 KiB of local memory for D = Dv = 64, so 8 groups share a gfx90a
 * CU). The kernel takes the same arguments as `attention` (attention.c), and attention.c's
 * macros (DQ_, DV_, AT_NAN, AT_FINITE; attention_mods.c's at_modify / at_in_window).
 *
 *  - Q (16 x DQP, DQP = D rounded up to 16, zero padded) is staged once as 16-bit patterns
 *    (through the K tile's local memory) and kept in A fragments for the whole key loop.
 *  - Per key tile: K (AM_BK x DQP) and V (AM_BK x DVP) are staged as 16-bit patterns, zeros
 *    past Sk, D and Dv. One item per key then zeroes its V row's NaN/inf entries and flags
 *    the row (Vb): that key scores NaN, as in attention.c.
 *  - S = Q K^T: DQP/16 tile products in the fp32 accumulator, then S * sf in fp32. fp16:
 *    q enters as it is and sf = scale (fp16 products are exact in fp32 and their sums stay
 *    far below its range). bf16: q enters as q * s2, s2 the largest power of two <= scale
 *    (exact), and sf = scale / s2 in [1, 2): the dot cannot overflow unless the scaled
 *    scores do, as on the SIMT path (attention.py's range rule).
 *    The products are called by every wave (uniform control flow); wave 0 stores the tile.
 *  - Items 0..15 (one per query row) apply exactly the SIMT path's per-key rules to their
 *    row of S (attention.c: at_modify, the mask, causal, the window, a bad V row's NaN,
 *    -inf for a dropped key), then the online softmax: the tile's max, the new running max
 *    m, corr = exp(m_old - m_new), l = l * corr + sum of p, p = exp(s - m) in fp32; p is
 *    rounded to the input type (16-bit patterns, P) for the product (attention.py's bound:
 *    u_storage relative on each weight, plus half the type's smallest subnormal), l sums
 *    the unrounded p. A row's m, l live in its item's registers; corr goes through Cs.
 *  - O (16 x DVP, fp32) lives in C fragments, DVP/16 of them split over the waves with a
 *    uniform count (AM_OPW per wave; a wave past the last real fragment multiplies a dummy
 *    one and never stores it). Each element is rescaled by its row's corr (the row from
 *    PK_MMA_C_ROW), then O += P V, AM_BK/16 tile products.
 *  - The end: O / l (0 for a dead row: max -inf and l exactly 0), and the lse, or with
 *    split (nsplit > 1) the range's partial (m, l, O) for attention_combine (attention.c).
 * Causal, window and split-K bound the key range per group as attention.c does. */
#define AM_WAVES (64 / PK_MMA_WAVE)
#define AM_DQP (((DQ_ + 15) / 16) * 16)
#define AM_DVP (((DV_ + 15) / 16) * 16)
#define AM_NQ (AM_DQP / 16)                           /* k steps of Q K^T */
#define AM_NO (AM_DVP / 16)                           /* output fragments */
#define AM_OPW ((AM_NO + AM_WAVES - 1) / AM_WAVES)    /* output fragments per wave */
#if AM_BK % 16 != 0 || AM_BK > 64 || 64 % PK_MMA_WAVE != 0
#error "attention MMA schedule: AM_BK a multiple of 16 up to 64, and a wave dividing 64"
#endif
#if AM_BF16
#define AM_EXP_MASK 0x7f80u
#define AM_TO_BITS(x) pk_float_to_bf16(x)
#else
#define AM_EXP_MASK 0x7c00u
#define AM_TO_BITS(x) am_float_to_f16_bits(x)
#endif

/* float -> fp16 bit pattern, rounded to nearest even (subnormals, overflow to inf, NaN) */
PK_DEVICE_FN unsigned short am_float_to_f16_bits(float f)
{
    const unsigned int x = PK_AS_UINT(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u); /* >= 65520: inf */
    if (ax < 0x33000000u) return (unsigned short)sign;                /* < 2^-25: 0 */
    const unsigned int e = ax >> 23;
    if (e < 113u) { /* below 2^-14: a subnormal, in units of 2^-24 */
        const unsigned int mant = (ax & 0x7fffffu) | 0x800000u;
        const unsigned int sh = 126u - e; /* 14..24 */
        unsigned int r = mant >> sh;
        const unsigned int rem = mant & ((1u << sh) - 1u), hf = 1u << (sh - 1u);
        r += (rem > hf || (rem == hf && (r & 1u))) ? 1u : 0u;
        return (unsigned short)(sign | r);
    }
    unsigned int r = ((e - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    const unsigned int rem = ax & 0x1fffu;
    r += (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ? 1u : 0u;
    return (unsigned short)(sign | r);
}

PK_KERNEL PK_MMA_KERNEL_ATTR PK_LAUNCH_BOUNDS(64, 8)
void attention_mma(PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                   PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                   PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                   PK_GLOBAL const unsigned char* PK_RESTRICT MASK,
                   PK_GLOBAL PK_T_T* PK_RESTRICT O,
                   PK_GLOBAL PK_ACC_T* PK_RESTRICT LSE,
                   PK_GLOBAL const PK_ACC_T* PK_RESTRICT KT,
                   PK_GLOBAL const PK_ACC_T* PK_RESTRICT VP,
                   PK_GLOBAL const PK_T_T* PK_RESTRICT BIAS,
                   PK_GLOBAL const float* PK_RESTRICT SLOPES,
                   int Sq, int Sk, int Hq, int group, int nqb, PK_ACC_T scale,
                   int causal, int has_mask, int ms0, int ms1, int ms2, int ms3, int Skp,
                   int wl, int wr, PK_ACC_T cap, int mods, int bs0, int bs1, int bs2, int bs3,
                   PK_GLOBAL PK_ACC_T* PK_RESTRICT PART, int nsplit, int chunk,
                   int lse_on)
{
    PK_LOCAL unsigned short Ks[AM_BK * AM_DQP]; /* Ks[j * AM_DQP + d]; Q first, once */
    PK_LOCAL unsigned short Vs[AM_BK * AM_DVP]; /* Vs[j * AM_DVP + d] */
    PK_LOCAL float Ss[16 * AM_BK];              /* Ss[r * AM_BK + j] */
    PK_LOCAL unsigned short Ps[16 * AM_BK];     /* Ps[r * AM_BK + j] */
    PK_LOCAL float Cs[16];                      /* each row's rescale of this tile */
    PK_LOCAL float Ls[16];
    PK_LOCAL float Ms[16];
    PK_LOCAL int Vb[AM_BK];                     /* the key's V row holds a NaN or an inf */
    PK_MMA_SCRATCH(scratch, AM_WAVES);
    const int tid = PK_LOCAL_ID(0);
    const int lane = PK_MMA_LANE(tid);
    const int wave = PK_MMA_WAVE_ID(tid);
    PK_LOCAL_PTR unsigned short* ws = scratch + wave * PK_MMA_SCRATCH_WORDS;

    const int gs = PK_GROUP_ID(0);
    const int g = gs / nsplit;
    const int split = gs - g * nsplit; /* (no %: attention.c's note on Oclgrind) */
    const int bh = g / nqb;
    const int qb = g - bh * nqb;
    const int b = bh / Hq;
    const int h = bh - b * Hq;
    const int Hkv = Hq / group;
    const int kvrow0 = (b * Hkv + h / group) * Sk;
    const int q0 = qb * 16;
    const PK_ACC_T slope = AT_HAS(AT_BIT_ALIBI) ? (PK_ACC_T)SLOPES[h] : (PK_ACC_T)0;
#define AM_BIAS_AT(brow, kj) \
    (AT_HAS(AT_BIT_BIAS) ? PK_LOAD_T(BIAS, (brow) + (kj) * bs3) : (PK_ACC_T)0)

    /* Q, once, through Ks: A fragments of the 16 rows, AM_NQ k steps. bf16: q * s2, s2 the
     * largest power of two <= scale (exact: bf16 has fp32's exponent range, save where
     * scale * q itself nears over- or underflow), and the dot is multiplied by the rest of
     * the scale, sf = scale / s2 in [1, 2), so the unscaled dot never exceeds the scaled
     * one. fp16 (its products <= 65504^2) takes the whole scale after the dot. */
#if AM_BF16
    const unsigned int se = PK_AS_UINT(scale) & 0x7f800000u;
    const PK_ACC_T s2 = PK_AS_FLOAT(se > 0x00800000u ? se : 0x00800000u);
    const PK_ACC_T sf = scale / s2;
#define AM_Q_BITS(i) pk_float_to_bf16(PK_LOAD_T(Q, i) * s2)
#else
    const PK_ACC_T sf = scale;
#define AM_Q_BITS(i) PK_BITS_T(Q, i)
#endif
    for (int idx = tid; idx < 16 * AM_DQP; idx += 64) {
        const int r = idx / AM_DQP, d = idx - (idx / AM_DQP) * AM_DQP;
        Ks[idx] = (q0 + r < Sq && d < DQ) ? AM_Q_BITS((bh * Sq + q0 + r) * DQ + d)
                                         : (unsigned short)0;
    }
    PK_BARRIER();
    pk_frag_a qf[AM_NQ];
    for (int kk = 0; kk < AM_NQ; ++kk) pk_mma_load_a(&qf[kk], Ks + kk * 16, AM_DQP, 1, lane);
    PK_BARRIER();

    pk_frag_c o[AM_OPW];
    for (int i = 0; i < AM_OPW; ++i) pk_mma_fill_c(&o[i], 0.0f);
    /* the row owned by items 0..15 (the others hold a copy they never use) */
    const int r = tid < 16 ? tid : 0;
    const int qi = q0 + r;
    const int mrow = b * ms0 + h * ms1 + min(qi, Sq - 1) * ms2;
    const int brow = b * bs0 + h * bs1 + min(qi, Sq - 1) * bs2;
    PK_ACC_T m = -PK_INFINITY, l = (PK_ACC_T)0;

    int kend = causal ? min(Sk, q0 + 16) : Sk;
    int kstart = 0;
    if (AT_HAS(AT_BIT_WIN)) {
        kstart = max(0, q0 - wl) / AM_BK * AM_BK;
        if (wr < kend - (q0 + 15)) kend = q0 + 16 + wr;
    }
    kstart = max(kstart, split * chunk); /* chunk: a multiple of AM_BK */
    kend = min(kend, split * chunk + chunk);
    for (int k0 = kstart; k0 < kend; k0 += AM_BK) {
        for (int idx = tid; idx < AM_BK * AM_DQP; idx += 64) {
            const int j = idx / AM_DQP, d = idx - (idx / AM_DQP) * AM_DQP;
            Ks[idx] = (k0 + j < Sk && d < DQ) ? PK_BITS_T(K, (kvrow0 + k0 + j) * DQ + d)
                                             : (unsigned short)0;
        }
        for (int idx = tid; idx < AM_BK * AM_DVP; idx += 64) {
            const int j = idx / AM_DVP, d = idx - (idx / AM_DVP) * AM_DVP;
            Vs[idx] = (k0 + j < Sk && d < DV) ? PK_BITS_T(V, (kvrow0 + k0 + j) * DV + d)
                                             : (unsigned short)0;
        }
        PK_BARRIER();
        /* one item per key: a V row with a NaN or an inf enters P V with those entries 0,
         * and its key scores NaN (read by the rows after the next barrier) */
        if (tid < AM_BK) {
            int bad = 0;
            for (int d = 0; d < AM_DVP; ++d) {
                const unsigned int x = Vs[tid * AM_DVP + d];
                if ((x & AM_EXP_MASK) == AM_EXP_MASK) {
                    bad = 1;
                    Vs[tid * AM_DVP + d] = (unsigned short)0;
                }
            }
            Vb[tid] = bad;
        }
        /* S = Q K^T for each 16-key subtile: every wave multiplies (uniform calls), wave 0
         * stores; B[k][n] = K[n][k] */
        for (int st = 0; st < AM_BK / 16; ++st) {
            pk_frag_c s;
            pk_mma_fill_c(&s, 0.0f);
            for (int kk = 0; kk < AM_NQ; ++kk) {
                pk_frag_b kf;
                pk_mma_load_b(&kf, Ks + st * 16 * AM_DQP + kk * 16, 1, AM_DQP, lane);
                PK_MMA_T(&s, &qf[kk], &kf, ws, lane);
            }
            if (wave == 0) pk_mma_store_c(&s, Ss + st * 16, AM_BK, 1, lane);
        }
        PK_BARRIER();
        /* the SIMT path's per-key rules and the online softmax, one item per query row */
        if (tid < 16) {
            PK_ACC_T bm = -PK_INFINITY;
            for (int j = 0; j < AM_BK; ++j) {
                const int kj = k0 + j;
                int ok = qi < Sq && kj < Sk && (!causal || kj <= qi);
                if (ok && AT_HAS(AT_BIT_WIN)) ok = at_in_window(qi, kj, wl, wr);
                if (ok && has_mask) ok = MASK[mrow + kj * ms3] != 0;
                PK_ACC_T sj = -PK_INFINITY;
                if (ok) {
                    sj = Ss[r * AM_BK + j] * sf; /* the scale (its rest) after the dot */
                    if (AT_HAS_MOD)
                        sj = at_modify(sj, AM_BIAS_AT(brow, kj), slope, qi, kj, cap, mods);
                    if (Vb[j]) sj = AT_NAN;
                }
                Ss[r * AM_BK + j] = sj;
                bm = (sj > bm || sj != sj) ? sj : bm;
            }
            PK_ACC_T corr = (PK_ACC_T)1;
            if (bm == -PK_INFINITY) { /* nothing to attend in this tile: weights 0 */
                for (int j = 0; j < AM_BK; ++j) Ps[r * AM_BK + j] = (unsigned short)0;
            } else {
                const PK_ACC_T mn = (bm > m || bm != bm) ? bm : m;
                if (mn != m) {
                    corr = exp(m - mn);
                    l *= corr;
                }
                for (int j = 0; j < AM_BK; ++j) {
                    const PK_ACC_T pj = exp(Ss[r * AM_BK + j] - mn); /* dropped: exp(-inf) */
                    l += pj;
                    Ps[r * AM_BK + j] = AM_TO_BITS(pj);
                }
                m = mn;
            }
            Cs[r] = corr;
        }
        PK_BARRIER();
        /* O = O * corr + P V: every wave AM_OPW fragments (a dummy past the last one) */
        for (int i = 0; i < AM_OPW; ++i) {
            const int f = i * AM_WAVES + wave;
            const int fc = f < AM_NO ? f : 0;
            for (int e = 0; e < PK_MMA_C_ELEMS; ++e) o[i].x[e] *= Cs[PK_MMA_C_ROW(lane, e)];
            for (int kk = 0; kk < AM_BK / 16; ++kk) {
                pk_frag_a pf;
                pk_frag_b vf;
                pk_mma_load_a(&pf, Ps + kk * 16, AM_BK, 1, lane);
                pk_mma_load_b(&vf, Vs + kk * 16 * AM_DVP + fc * 16, AM_DVP, 1, lane);
                PK_MMA_T(&o[i], &pf, &vf, ws, lane);
            }
        }
        PK_BARRIER();
    }

    if (tid < 16) {
        Ms[r] = m;
        Ls[r] = l;
        if (qi < Sq && nsplit > 1) {
            PK_GLOBAL PK_ACC_T* part = PART + ((bh * Sq + qi) * nsplit + split) * (DV_ + 2);
            part[0] = m;
            part[1] = l;
        } else if (qi < Sq && lse_on) {
            const int dead = m == -PK_INFINITY && l == (PK_ACC_T)0;
            LSE[bh * Sq + qi] = dead ? -(PK_ACC_T)PK_INFINITY : m + log(l);
        }
    }
    PK_BARRIER();
    for (int i = 0; i < AM_OPW; ++i) {
        const int f = i * AM_WAVES + wave;
        if (f >= AM_NO) continue;
        for (int e = 0; e < PK_MMA_C_ELEMS; ++e) {
            const int rr = PK_MMA_C_ROW(lane, e), n = f * 16 + PK_MMA_C_COL(lane, e);
            const int qq = q0 + rr;
            if (qq >= Sq || n >= DV) continue;
            const PK_ACC_T x = o[i].x[e]; /* read once, before the branch: o stays in registers */
            if (nsplit > 1) {
                PART[((bh * Sq + qq) * nsplit + split) * (DV_ + 2) + 2 + n] = x;
            } else {
                const PK_ACC_T mr = Ms[rr], lr = Ls[rr];
                const int dead = mr == -PK_INFINITY && lr == (PK_ACC_T)0;
                const PK_ACC_T inv = dead ? (PK_ACC_T)0 : (PK_ACC_T)1 / lr;
                PK_STORE_T(O, (bh * Sq + qq) * DV + n, x * inv);
            }
        }
    }
}
#endif

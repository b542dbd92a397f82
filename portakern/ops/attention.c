/* O = softmax(scale * Q K^T  [causal, mask]) V, fused: the Sq x Sk scores never leave the chip.
 *
 * Layouts (contiguous): Q (B, Hq, Sq, D), K (B, Hkv, Sk, D), V (B, Hkv, Sk, DV), O (B, Hq, Sq, DV);
 * MASK: bytes (1 = attend) addressed with broadcast strides ms0..ms3 (0 on broadcast dims).
 * Grouped-query attention: query head h reads kv head h / group.
 *
 * One work-group = QB = BQ*RQ*TQ queries of one (batch, head); one work-item = RQ blocks of
 * TQ query rows; a block's scores and output accumulators live in registers for a tile.
 * Key/value tiles of BK rows are staged in local memory and shared by the group (or, with
 * PACK_KV, read in place from packed copies). Online softmax per tile
 * (FlashAttention): scores of the tile -> tile max -> one rescale of (l, acc) -> accumulate.
 * Causal: tiles wholly after the group's last query are never loaded; on the vector path the
 * diagonal tile masks by a vector select. A row with no key to
 * attend (fully masked, or Sk = 0) writes 0.
 *
 * Score modifiers and the window (attention_mods.c): bias, ALiBi, soft cap, applied to each
 * kept key's scaled score before the online softmax; a window also bounds the tiles a group
 * loads (tiles wholly outside every query's window are never loaded). With any modifier on,
 * the vector path takes its key-by-key (masked) branch for every tile.
 *
 * Split-K (nsplit > 1, decode: few queries, many keys): the keys are cut into nsplit ranges
 * of `chunk` keys (a multiple of BK) and each work-group takes one (batch, head, query
 * block, range): the group index runs over ranges fastest. A group writes its rows' partial
 * state, PART[(row * nsplit + split) * (DV_ + 2) + ...] = (max, sum, unnormalised acc), and
 * attention_combine merges the ranges in a fixed order (deterministic): M = the ranges' max,
 * each range weighted by exp(m - M) (0 for a range with nothing attended), then the output
 * and the lse as without the split.
 *
 * lse_on (return_lse=True): each row's log-sum-exp m + log(l) is written to LSE (B, Hq, Sq)
 * in the compute type; without it LSE is never touched. Both are run-time arguments, not
 * compile-time switches: they act once per row, after the key loop, and as switches they
 * multiplied the kernels compiled per shape.
 *
 * Non-finite values, as attention.semantics: the scale is folded into q before the dot; a key
 * whose V row holds a NaN or an inf scores NaN (AT_NAN) for the rows allowed to attend it,
 * and V enters P.V with those entries zeroed, so a masked key (weight 0) never poisons a row;
 * a NaN or +inf score makes the row NaN through exp(s - m); a row is dead (writes 0) only
 * when its max is -inf and its sum is exactly 0 (the vector max, fmax, skips NaN, which then
 * shows in the sum): never because !(l > 0).
 *
 * Two inner paths, one source. GPU schedule (TQ=1, VEC=1): scalar, one query per item, the
 * group's many items hide latency. CPU schedule on dialects with native vectors (OpenCL):
 * the K tile is stored transposed so VEC consecutive keys' scores are one vector FMA chain,
 * and the P.V product runs on VEC-wide slices of V rows; each item's TQ queries reuse every
 * tile load TQ times (register blocking, as in matmul).
 */
#define DQ_ (DQ > 0 ? DQ : 1)
#define DV_ (DV > 0 ? DV : 1)
#define QI (RQ * TQ) /* queries per work-item */
#define QB (BQ * QI)  /* queries per work-group */
/* Groups of BQ items that should be resident on one multiprocessor at once (CUDA's
 * __launch_bounds__ minimum; ptxas then keeps registers under 65536 / (groups * BQ)). The
 * scalar path's live state is DV accumulators (two words each in fp64) + AT_SB scores: up to
 * 64 words it fits 128 registers, a quarter of an SM's 2048 threads; up to 160 words, 255
 * registers (an eighth); above that no bound is asked (it would only force spills). */
#define AT_ACC_WORDS (DV_ * (PK_ACC_IS_FLOAT_T ? 1 : 2))
#define AT_MIN_ITEMS (AT_ACC_WORDS <= 64 ? 512 : AT_ACC_WORDS <= 160 ? 256 : 1)
#define AT_MIN_GROUPS (AT_MIN_ITEMS / BQ > 0 ? AT_MIN_ITEMS / BQ : 1)
#define AT_VEC (VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T && (BK % VEC) == 0)
#define AT_SB (BK < 8 ? BK : 8) /* keys per online-softmax step of the scalar path */
#define DVP (((DV_ + VEC - 1) / VEC) * VEC) /* V rows padded to whole vectors */
/* PACK_KV (CPU schedule): K and V are first copied, once, into zero-padded workspaces: KT
 * (per kv head and key tile, DQ rows of BK keys: each tile of K transposed and contiguous, so
 * its rows do not crowd into the few cache sets that rows Skp floats apart would share) and
 * VP (Skp rows of DVP). The vector path then reads its tiles straight from them: no
 * local-memory staging and no barriers. */
#define AT_PACKED (AT_VEC && PACK_KV)
#define AT_NAN ((PK_ACC_T)PK_INFINITY - (PK_ACC_T)PK_INFINITY)
#define AT_FINITE(x) ((x) - (x) == (PK_ACC_T)0) /* false for NaN and +-inf */
#if AT_VEC
#define NSV (BK / VEC)
#define NAV (DVP / VEC)
typedef PK_CAT(PK_ACC_T, VEC) at_vt;
/* max of a vector's lanes as a tree: log2(VEC) dependent steps, not VEC - 1 */
PK_DEVICE_FN PK_ACC_T at_lane_max(at_vt v)
{
    PK_ACC_T* e = (PK_ACC_T*)&v;
    #pragma unroll
    for (int w = VEC / 2; w >= 1; w /= 2)
        #pragma unroll
        for (int i = 0; i < w; ++i) e[i] = fmax(e[i], e[i + w]);
    return e[0];
}
PK_DEVICE_FN PK_ACC_T at_lane_sum(at_vt v)
{
    PK_ACC_T* e = (PK_ACC_T*)&v;
    #pragma unroll
    for (int w = VEC / 2; w >= 1; w /= 2)
        #pragma unroll
        for (int i = 0; i < w; ++i) e[i] += e[i + w];
    return e[0];
}
#endif

/* KT[kvh * DQ_ * Skp + (tile * DQ_ + d) * BK + jj] = K[kvh][tile * BK + jj][d],
 * VP[(kvh * Skp + j) * DVP + d] = V[kvh][j][d], zeros past Sk and past DV.
 * A V row holding a NaN or an inf is copied with those entries zeroed and its key's KT column
 * is NaN (every score of that key NaN; masks still turn it to -inf).
 * One work-item per key row; groups of BK rows, kv heads along the group index. */
PK_KERNEL void attention_pack_kv(PK_GLOBAL const PK_T_T* PK_RESTRICT K,
                                 PK_GLOBAL const PK_T_T* PK_RESTRICT V,
                                 PK_GLOBAL PK_ACC_T* PK_RESTRICT KT,
                                 PK_GLOBAL PK_ACC_T* PK_RESTRICT VP, int Sk, int Skp)
{
    const int tiles = Skp / BK;
    const int g = PK_GROUP_ID(0);
    const int kvh = g / tiles;
    const int tile = g - kvh * tiles;
    const int jj = PK_LOCAL_ID(0);
    const int j = tile * BK + jj;
    const int ok = j < Sk;
    int bad = 0;
    for (int d = 0; d < DVP; ++d) {
        PK_ACC_T x = (ok && d < DV) ? PK_LOAD_T(V, (kvh * Sk + j) * DV + d) : (PK_ACC_T)0;
        if (!AT_FINITE(x)) {
            bad = 1;
            x = (PK_ACC_T)0;
        }
        VP[(kvh * Skp + j) * DVP + d] = x;
    }
    for (int d = 0; d < DQ_; ++d)
        KT[kvh * DQ_ * Skp + (tile * DQ_ + d) * BK + jj] =
            bad ? AT_NAN : (ok && d < DQ) ? PK_LOAD_T(K, (kvh * Sk + j) * DQ + d) : (PK_ACC_T)0;
}

PK_KERNEL PK_LAUNCH_BOUNDS(BQ, AT_MIN_GROUPS) void attention(PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
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
                         int wl, int wr, PK_ACC_T cap, int mods,
                         int bs0, int bs1, int bs2, int bs3,
                         PK_GLOBAL PK_ACC_T* PK_RESTRICT PART, int nsplit, int chunk,
                         int lse_on)
{
    const int gs = PK_GROUP_ID(0);
    const int g = gs / nsplit;
    /* the key range: fastest, so a row's ranges run together (not gs % nsplit: Oclgrind
     * 21.10 cannot run the `freeze` its compiler then emits) */
    const int split = gs - g * nsplit;
    const int bh = g / nqb;
    const int qb = g - bh * nqb;
    const int b = bh / Hq;
    const int h = bh - b * Hq;
    const int Hkv = Hq / group;
    const int kvrow0 = (b * Hkv + h / group) * Sk;
    const int lid = PK_LOCAL_ID(0);
    const int q0 = qb * QB + lid * QI; /* this item's first query */
    const PK_ACC_T slope = AT_HAS(AT_BIT_ALIBI) ? (PK_ACC_T)SLOPES[h] : (PK_ACC_T)0;
    /* a kept key's modified score (attention_mods.c); brow: the query's bias row */
#define AT_BIAS_AT(brow, kj) \
    (AT_HAS(AT_BIT_BIAS) ? PK_LOAD_T(BIAS, (brow) + (kj) * bs3) : (PK_ACC_T)0)
#define AT_SCORE(s, brow, qi, kj) \
    (AT_HAS_MOD ? at_modify((s), AT_BIAS_AT(brow, kj), slope, (qi), (kj), cap, mods) : (s))
#define AT_KEEP(qi, kj) (!AT_HAS(AT_BIT_WIN) || at_in_window((qi), (kj), wl, wr))

#if AT_VEC
    typedef at_vt vt;
#if AT_PACKED
    const PK_GLOBAL PK_ACC_T* kth = KT + (b * Hkv + h / group) * DQ_ * Skp;
    const PK_GLOBAL PK_ACC_T* vph = VP + (b * Hkv + h / group) * Skp * DVP;
#define AT_KROW(d) (kth + (k0 / BK * DQ_ + (d)) * BK) /* keys k0.. of dimension d */
#define AT_VROW(j) (vph + (k0 + (j)) * DVP)
#else
    PK_LOCAL PK_ACC_T Kt[DQ_][BK]; /* transposed: Kt[d][j] = K[k0 + j][d] */
    PK_LOCAL PK_ACC_T Vs[BK][DVP];
#define AT_KROW(d) (&Kt[d][0])
#define AT_VROW(j) (&Vs[j][0])
#endif
    vt acc[QI][NAV];
    vt lsum[QI]; /* running softmax denominators, lane-wise: summed across lanes at the end */
    for (int t = 0; t < QI; ++t) {
        lsum[t] = (vt)(0);
        #pragma unroll
        for (int c = 0; c < NAV; ++c) acc[t][c] = (vt)(0);
    }
#else
    PK_LOCAL PK_ACC_T Ks[BK][DQ_];
    PK_LOCAL PK_ACC_T Vs[BK][DV_];
    PK_ACC_T acc[QI][DV_];
    for (int t = 0; t < QI; ++t)
        #pragma unroll
        for (int d = 0; d < DV; ++d) acc[t][d] = (PK_ACC_T)0;
#endif
    /* Query element d of the item's query t, scaled. The vector path keeps its query rows in
     * registers (qr); the scalar (GPU) path reads them again for each tile, from the cache, so
     * its registers hold only the DV accumulators and one tile's BK scores, every one indexed
     * by a constant in an unrolled loop (else the array lives on the stack: local/scratch
     * memory on a GPU, as `portakern resources attention` would show). */
#define AT_Q(t, d) (PK_LOAD_T(Q, (bh * Sq + min(q0 + (t), Sq - 1)) * DQ + (d)) * scale)
#if !AT_PACKED
    /* Staged tiles: the loaders zero a V row's NaN/inf entries and stamp the row (and the
     * tile) with k0 + 1, so a stamp from an earlier tile never matches. Every loader that
     * stamps writes the same value. */
    PK_LOCAL int Vbad[BK];
    PK_LOCAL int Tbad[1];
    for (int j = lid; j < BK; j += BQ) Vbad[j] = 0;
    if (lid == 0) Tbad[0] = 0;
    PK_BARRIER();
#define AT_VBAD(j) (Vbad[j] == k0 + 1)
#define AT_TBAD (Tbad[0] == k0 + 1)
#else
#define AT_TBAD 0 /* the packed KT column of a bad V row is NaN already */
#endif
#if AT_VEC
    PK_ACC_T qr[QI][DQ_];
#else
    PK_ACC_T sc[AT_SB];
#endif
    PK_ACC_T m[QI], l[QI];
    for (int t = 0; t < QI; ++t) {
#if AT_VEC
        /* the scale folded into q once (every implementation does): no dot * scale - max;
         * zeros past DQ (a D = 0 packed problem still reads its KT row) */
        for (int d = 0; d < DQ_; ++d) qr[t][d] = (d < DQ) ? AT_Q(t, d) : (PK_ACC_T)0;
#endif
        m[t] = -PK_INFINITY;
        l[t] = (PK_ACC_T)0;
    }

    int kend = causal ? min(Sk, qb * QB + QB) : Sk;
    int kstart = 0;
    if (AT_HAS(AT_BIT_WIN)) {
        /* the group's queries qb*QB .. qb*QB + QB - 1 attend keys from first - wl to last
         * + wr: whole tiles outside that range are skipped (kstart stays a multiple of BK) */
        kstart = max(0, qb * QB - wl) / BK * BK;
        if (wr < kend - (qb * QB + QB - 1)) kend = qb * QB + QB + wr;
    }
    /* this group's key range (the whole of it without a split); chunk is a multiple of BK */
    kstart = max(kstart, split * chunk);
    kend = min(kend, split * chunk + chunk);
    for (int k0 = kstart; k0 < kend; k0 += BK) {
#if AT_PACKED
        /* tiles are read from KT/VP in place */
#elif AT_VEC
        for (int idx = lid; idx < BK * DQ; idx += BQ) {
            const int j = idx / DQ, d = idx - (idx / DQ) * DQ;
            Kt[d][j] = (k0 + j < Sk) ? PK_LOAD_T(K, (kvrow0 + k0 + j) * DQ + d) : (PK_ACC_T)0;
        }
        if (DVP == DV && k0 + BK <= Sk) {
            for (int idx = lid; idx < BK * NAV; idx += BQ) {
                const int j = idx / NAV, c = idx - (idx / NAV) * NAV;
                vt x = PK_CAT(vload, VEC)(c, V + (kvrow0 + k0 + j) * DV);
                if (!all(isequal(x - x, (vt)(0)))) { /* a NaN or an inf in this V row */
                    x = select((vt)(0), x, isequal(x - x, (vt)(0)));
                    Vbad[j] = k0 + 1;
                    Tbad[0] = k0 + 1;
                }
                PK_CAT(vstore, VEC)(x, c, &Vs[j][0]);
            }
        } else {
            for (int idx = lid; idx < BK * DVP; idx += BQ) {
                const int j = idx / DVP, d = idx - (idx / DVP) * DVP;
                PK_ACC_T x = (k0 + j < Sk && d < DV) ? PK_LOAD_T(V, (kvrow0 + k0 + j) * DV + d)
                                                     : (PK_ACC_T)0;
                if (!AT_FINITE(x)) {
                    x = (PK_ACC_T)0;
                    Vbad[j] = k0 + 1;
                    Tbad[0] = k0 + 1;
                }
                Vs[j][d] = x;
            }
        }
#else
        for (int idx = lid; idx < BK * DQ; idx += BQ) {
            const int j = idx / DQ, d = idx - (idx / DQ) * DQ;
            Ks[j][d] = (k0 + j < Sk) ? PK_LOAD_T(K, (kvrow0 + k0 + j) * DQ + d) : (PK_ACC_T)0;
        }
        for (int idx = lid; idx < BK * DV; idx += BQ) {
            const int j = idx / DV, d = idx - (idx / DV) * DV;
            PK_ACC_T x = (k0 + j < Sk) ? PK_LOAD_T(V, (kvrow0 + k0 + j) * DV + d) : (PK_ACC_T)0;
            if (!AT_FINITE(x)) {
                x = (PK_ACC_T)0;
                Vbad[j] = k0 + 1;
            }
            Vs[j][d] = x;
        }
#endif
#if !AT_PACKED
        PK_BARRIER();
#endif

#if AT_VEC
        /* The item's RQ sub-blocks of TQ queries take the tile in turn while it is hot in
         * the cache: K and V stream from memory once per QI queries, not once per TQ. */
        for (int r = 0; r < RQ; ++r) {
            const int t0 = r * TQ;
            /* scores of the tile: TQ x BK, VEC keys per vector FMA chain */
            vt sv[TQ][NSV];
            #pragma unroll
            for (int t = 0; t < TQ; ++t)
                #pragma unroll
                for (int c = 0; c < NSV; ++c) sv[t][c] = (vt)(0);
            /* packed: DQ_ rows, so a D = 0 problem still reads a bad V row's NaN column */
            for (int d = 0; d < (AT_PACKED ? DQ_ : DQ); ++d) {
                vt kv[NSV];
                #pragma unroll
                for (int c = 0; c < NSV; ++c) kv[c] = PK_CAT(vload, VEC)(c, AT_KROW(d));
                #pragma unroll
                for (int t = 0; t < TQ; ++t) {
                    const vt qd = (vt)(qr[t0 + t][d]);
                    #pragma unroll
                    for (int c = 0; c < NSV; ++c) sv[t][c] = fma(qd, kv[c], sv[t][c]);
                }
            }
            /* The accumulators are copied into a tile-local array: acc lives across tiles
             * (and barriers), so a CPU OpenCL runtime keeps it in memory per work-item and
             * every FMA into it would load and store; a copy that dies inside the tile can
             * stay in registers. */
            vt a[TQ][NAV];
            #pragma unroll
            for (int t = 0; t < TQ; ++t)
                #pragma unroll
                for (int c = 0; c < NAV; ++c) a[t][c] = acc[t0 + t][c];
            /* per query: new running max, one rescale of (l, acc), probabilities into pt[t] */
            PK_ACC_T pt[TQ][BK];
            PK_ACC_T bmask[TQ]; /* masked tiles: each row's max over the keys it may attend */
            int on[TQ]; /* the query has a key to attend in this tile */
            /* A tile edge, a mask, a bad V row or a modifier: key by key, through memory, in a
             * loop of its own (rolled: one copy of this code, not TQ) before the unrolled one. */
            const int masked = has_mask || k0 + BK > Sk
                               || AT_TBAD /* a bad V row: key by key, below */
                               || AT_MODS;
            /* The causal diagonal alone (the test uses the block's first query, the one the
             * causal bound cuts most): a key after its query scores -inf by one vector select
             * per score vector, and the tile then takes the unmasked path, whose online
             * softmax gives those keys weight exp(-inf - m) = 0 (a row with no key here keeps
             * its state: corr 1, p 0). Against key by key: causal S = 1024 ~7-10% faster on
             * Intel's runtime (one tile in eight per row block), within noise at 4096. */
            const int diag = !masked && causal && k0 + BK - 1 > q0 + t0;
            if (diag) {
                PK_ACC_T lane[VEC];
                #pragma unroll
                for (int i = 0; i < VEC; ++i) lane[i] = (PK_ACC_T)i;
                const vt iota = PK_CAT(vload, VEC)(0, lane);
                #pragma unroll
                for (int t = 0; t < TQ; ++t)
                    #pragma unroll
                    for (int c = 0; c < NSV; ++c) /* key k0 + c*VEC + i kept when <= query */
                        sv[t][c] = select(sv[t][c], (vt)(-PK_INFINITY),
                                          iota > (vt)((PK_ACC_T)(q0 + t0 + t - k0 - c * VEC)));
            }
            if (masked) {
                #pragma unroll
                for (int t = 0; t < TQ; ++t)
                    #pragma unroll
                    for (int c = 0; c < NSV; ++c) PK_CAT(vstore, VEC)(sv[t][c], c, &pt[t][0]);
                for (int t = 0; t < TQ; ++t) {
                    const int qi = q0 + t0 + t;
                    const int mrow = b * ms0 + h * ms1 + min(qi, Sq - 1) * ms2;
                    const int brow = b * bs0 + h * bs1 + min(qi, Sq - 1) * bs2;
                    PK_ACC_T bm = -PK_INFINITY;
                    for (int j = 0; j < BK; ++j) {
                        const int kj = k0 + j;
                        int ok = kj < Sk && (!causal || kj <= qi) && AT_KEEP(qi, kj);
                        if (ok && has_mask) ok = MASK[mrow + kj * ms3] != 0;
#if AT_PACKED
                        const PK_ACC_T sj = ok ? AT_SCORE(pt[t][j], brow, qi, kj) : -PK_INFINITY;
#else
                        const PK_ACC_T sj = !ok ? -PK_INFINITY : AT_VBAD(j) ? AT_NAN
                                            : AT_SCORE(pt[t][j], brow, qi, kj);
#endif
                        pt[t][j] = sj;
                        bm = (sj > bm || sj != sj) ? sj : bm;
                    }
                    bmask[t] = bm;
                }
                #pragma unroll
                for (int t = 0; t < TQ; ++t)
                    #pragma unroll
                    for (int c = 0; c < NSV; ++c) sv[t][c] = PK_CAT(vload, VEC)(c, &pt[t][0]);
            }
            #pragma unroll
            for (int t = 0; t < TQ; ++t) {
                on[t] = 1;
                PK_ACC_T mn;
                if (!masked) {
                    /* nothing masked: the max stays in vectors */
                    vt bmv = sv[t][0];
                    #pragma unroll
                    for (int c = 1; c < NSV; ++c) bmv = fmax(bmv, sv[t][c]);
                    /* the max seldom moves after the first tiles: one vector compare, and
                     * the lane reduction (through memory on PoCL) only when a lane exceeds
                     * it; same value as fmax(lane max, m) (NaN lanes compare false, as fmax
                     * skips them; a NaN m takes the reduction). The lanes' test is ORed in
                     * halves: PoCL's any() is a chain of per-lane-pair tests and branches */
                    const PK_ACC_T mo = m[t0 + t];
#if VEC == 16 && PK_ACC_IS_FLOAT_T
                    const int16 up = bmv > (vt)(mo); /* a double compare gives long lanes */
                    const int8 u8 = up.lo | up.hi;
                    const int4 u4 = u8.lo | u8.hi;
                    /* the last pair through any(): u2.x | u2.y, as Oclgrind compiles it,
                     * reads a lane no compare wrote ("control flow depends on an uninitialised
                     * value", though every lane of up is written: tests/test_simulator.py) */
                    const int moved = any(u4.lo | u4.hi);
#else
                    const int moved = any(bmv > (vt)(mo));
#endif
                    mn = (moved || mo != mo) ? fmax(at_lane_max(bmv), mo) : mo;
                } else {
                    const PK_ACC_T bm = bmask[t];
                    if (bm == -PK_INFINITY) { /* nothing to attend: this row skips the tile */
                        on[t] = 0;
                        continue;
                    }
                    mn = (bm > m[t0 + t] || bm != bm) ? bm : m[t0 + t];
                }
                /* the max seldom moves after the first tiles: no exp then */
                const PK_ACC_T corr = (mn == m[t0 + t]) ? (PK_ACC_T)1 : exp(m[t0 + t] - mn);
                /* every score so far -inf (from the data, in an unmasked tile): shift by 0 */
                const PK_ACC_T ms = (mn == -PK_INFINITY) ? (PK_ACC_T)0 : mn;
                #pragma unroll
                for (int c = 0; c < NAV; ++c) a[t][c] *= (vt)(corr);
                vt lv = lsum[t0 + t] * (vt)(corr);
                #pragma unroll
                for (int c = 0; c < NSV; ++c) {
                    const vt p = PK_VEXP(sv[t][c] - (vt)(ms)); /* masked keys: exp(-inf) = 0 */
                    lv += p;
                    PK_CAT(vstore, VEC)(p, c, &pt[t][0]);
                }
                lsum[t0 + t] = lv;
                m[t0 + t] = mn;
            }
            /* P.V: each V row is loaded once and used by all TQ queries. A row that skipped
             * the tile weighs every key 0 (V is finite: bad entries were zeroed), so the FMAs
             * run unconditionally: tested per FMA, PoCL kept a taken branch beside each one
             * (the test was not unswitched). Each V vector is loaded just
             * before its TQ FMAs: a whole row loaded first lives beside the TQ x NAV
             * accumulators, more than AVX2's 16 registers hold (spilled accumulators: 1.1-1.25x
             * slower at S = 512-1024 on a Zen) */
            for (int j = 0; j < BK; ++j) {
                vt pv[TQ];
                #pragma unroll
                for (int t = 0; t < TQ; ++t) /* (a skipped row never wrote its pt) */
                    pv[t] = (vt)(on[t] ? pt[t][j] : (PK_ACC_T)0);
                #pragma unroll
                for (int c = 0; c < NAV; ++c) {
                    const vt x = PK_CAT(vload, VEC)(c, AT_VROW(j));
                    #pragma unroll
                    for (int t = 0; t < TQ; ++t) a[t][c] = fma(pv[t], x, a[t][c]);
                }
            }
            #pragma unroll
            for (int t = 0; t < TQ; ++t)
                #pragma unroll
                for (int c = 0; c < NAV; ++c) acc[t0 + t][c] = a[t][c];
        }
#else
        for (int t = 0; t < QI; ++t) {
            const int qi = q0 + t;
            const int mrow = b * ms0 + h * ms1 + min(qi, Sq - 1) * ms2;
            const int brow = b * bs0 + h * bs1 + min(qi, Sq - 1) * bs2;
            /* The tile in sub-blocks of AT_SB keys, each an online-softmax step: scores with
             * query elements outer (one cached read each, used AT_SB times) and keys inner,
             * unrolled, so sc[] stays in registers; then the probabilities; then P.V,
             * AT_SB x DV unrolled FMAs. Sub-blocks bound what is live at once (DV
             * accumulators + AT_SB scores) whatever BK is. */
            for (int jb = 0; jb < BK; jb += AT_SB) {
                #pragma unroll
                for (int j = 0; j < AT_SB; ++j) sc[j] = (PK_ACC_T)0;
                for (int d = 0; d < DQ; ++d) {
                    const PK_ACC_T qd = AT_Q(t, d);
                    #pragma unroll
                    for (int j = 0; j < AT_SB; ++j) sc[j] += qd * Ks[jb + j][d];
                }
                PK_ACC_T bm = -PK_INFINITY;
                #pragma unroll
                for (int j = 0; j < AT_SB; ++j) {
                    const int kj = k0 + jb + j;
                    int ok = kj < Sk && (!causal || kj <= qi) && AT_KEEP(qi, kj);
                    if (ok && has_mask) ok = MASK[mrow + kj * ms3] != 0;
                    /* a key whose V row holds a NaN or an inf scores NaN */
                    const PK_ACC_T s = !ok ? -PK_INFINITY : AT_VBAD(jb + j) ? AT_NAN
                                       : AT_SCORE(sc[j], brow, qi, kj);
                    sc[j] = s;
                    bm = (s > bm || s != s) ? s : bm;
                }
                if (bm == -PK_INFINITY) continue; /* nothing to attend in this sub-block */
                const PK_ACC_T mn = (bm > m[t] || bm != bm) ? bm : m[t];
                if (mn != m[t]) { /* the max seldom moves after the first keys: no rescale */
                    const PK_ACC_T corr = exp(m[t] - mn);
                    l[t] *= corr;
                    /* unrolled by the compiler (constant trip count, constant indices) */
                    for (int d = 0; d < DV; ++d) acc[t][d] *= corr;
                }
                #pragma unroll
                for (int j = 0; j < AT_SB; ++j) {
                    sc[j] = exp(sc[j] - mn);
                    l[t] += sc[j];
                }
                #pragma unroll
                for (int j = 0; j < AT_SB; ++j)
                    #pragma unroll
                    for (int d = 0; d < DV; ++d) acc[t][d] += sc[j] * Vs[jb + j][d];
                m[t] = mn;
            }
        }
#endif
#if !AT_PACKED
        PK_BARRIER();
#endif
    }

    for (int t = 0; t < QI; ++t) {
        const int qi = q0 + t;
        if (qi >= Sq) continue;
#if AT_VEC
        l[t] = at_lane_sum(lsum[t]);
#endif
        if (nsplit > 1) {   /* this range's partial state; attention_combine finishes the row */
            PK_GLOBAL PK_ACC_T* part = PART + ((bh * Sq + qi) * nsplit + split) * (DV_ + 2);
            part[0] = m[t];
            part[1] = l[t];
#if AT_VEC
            PK_ACC_T* ar = (PK_ACC_T*)&acc[t][0];
            for (int d = 0; d < DV; ++d) part[2 + d] = ar[d];
#else
            #pragma unroll
            for (int d = 0; d < DV; ++d) part[2 + d] = acc[t][d];
#endif
            continue;
        }
        /* dead: no key attended (max -inf, sum exactly 0); a NaN sum is alive and stays NaN */
        const int dead = m[t] == -PK_INFINITY && l[t] == (PK_ACC_T)0;
        const PK_ACC_T inv = dead ? (PK_ACC_T)0 : (PK_ACC_T)1 / l[t];
        /* the row's log-sum-exp, scale included (the backward recomputes P from it): -inf
         * for a dead row; NaN wherever l is (the row's output is NaN there too) */
        if (lse_on) LSE[bh * Sq + qi] = dead ? -(PK_ACC_T)PK_INFINITY : m[t] + log(l[t]);
#if AT_VEC
        PK_ACC_T* ar = (PK_ACC_T*)&acc[t][0];
        for (int d = 0; d < DV; ++d) PK_STORE_T(O, (bh * Sq + qi) * DV + d, ar[d] * inv);
#else
        #pragma unroll
        for (int d = 0; d < DV; ++d) PK_STORE_T(O, (bh * Sq + qi) * DV + d, acc[t][d] * inv);
#endif
    }
}

/* Split-K's second pass: one work-item per query row merges the row's nsplit partial states
 * in range order (deterministic). A range that attended nothing (max -inf, sum 0) weighs 0;
 * a NaN max or sum makes the row NaN, as in one pass; the row is dead (0, lse -inf) when
 * every range is. */
PK_KERNEL void attention_combine(PK_GLOBAL const PK_ACC_T* PK_RESTRICT PART,
                                 PK_GLOBAL PK_T_T* PK_RESTRICT O,
                                 PK_GLOBAL PK_ACC_T* PK_RESTRICT LSE, int rows, int nsplit,
                                 int lse_on)
{
    const int row = PK_GROUP_ID(0) * PK_LOCAL_SIZE(0) + PK_LOCAL_ID(0);
    if (row >= rows) return;
    PK_GLOBAL const PK_ACC_T* part = PART + row * nsplit * (DV_ + 2);
    PK_ACC_T mx = -PK_INFINITY;
    int nan = 0;
    for (int s = 0; s < nsplit; ++s) {
        const PK_ACC_T ms = part[s * (DV_ + 2)];
        nan |= ms != ms;
        mx = ms > mx ? ms : mx;
    }
    PK_ACC_T l = (PK_ACC_T)0;
    for (int s = 0; s < nsplit; ++s) {
        const PK_ACC_T ms = part[s * (DV_ + 2)];
        const PK_ACC_T w = (ms == -PK_INFINITY) ? (PK_ACC_T)0 : exp(ms - mx);
        l += w * part[s * (DV_ + 2) + 1];
    }
    if (nan) l = AT_NAN;
    const int dead = mx == -PK_INFINITY && l == (PK_ACC_T)0;
    const PK_ACC_T inv = dead ? (PK_ACC_T)0 : (PK_ACC_T)1 / l;
    if (lse_on) LSE[row] = dead ? -(PK_ACC_T)PK_INFINITY : mx + log(l);
    for (int d = 0; d < DV; ++d) {
        PK_ACC_T a = (PK_ACC_T)0;
        for (int s = 0; s < nsplit; ++s) {
            const PK_ACC_T ms = part[s * (DV_ + 2)];
            const PK_ACC_T w = (ms == -PK_INFINITY) ? (PK_ACC_T)0 : exp(ms - mx);
            a += w * part[s * (DV_ + 2) + 2 + d];
        }
        PK_STORE_T(O, row * DV + d, (nan ? AT_NAN : a) * inv);
    }
}

/* Paged decode attention (vLLM's PagedAttention layout) with split-K (flash-decoding).
 *
 * Layouts (contiguous): Q (B, Hq, Sq, DQ); KC (NB, Hkv, BS, DQ) and VC (NB, Hkv, BS, DV), the
 * page pool; BT (B, MB) int block table; SL (B,) int, tokens in the cache per sequence (the Sq
 * new ones included); O (B, Hq, Sq, DV). Token t of sequence b sits in page BT[b][t / BS] at
 * slot t % BS. Query i of sequence b sits at position SL[b] - Sq + i and attends positions
 * <= its own (causal, bottom-right aligned), further bounded by the window (the window, attention_mods.c).
 *
 * One work-group = one (split, sequence, group of HEADS kv heads, block of RB query rows).
 * Its rows are the G = Hq / Hkv query heads sharing a kv head times the Sq queries
 * (grouped-query packing): each K/V page is read once for all of them. The split s covers
 * pages [s*pps, (s+1)*pps). With HEADS > 1 the CPU schedule takes each page of the table
 * for all its heads in turn (page-major): a block's heads sit side by side in the pool
 * (NB, Hkv, BS, D), so the group reads Hkv * BS * D contiguous elements a page where one
 * head alone reads a 1 / Hkv slice of them and jumps; the scalar path runs its heads one
 * after another.
 * PA_SPLIT = 0: one split, the group writes O. PA_SPLIT = 1: the group writes its partial
 * (max PM, sum PL, unnormalised accumulator PA) and paged_attention_combine merges the splits
 * in a fixed order (split 0 first): deterministic, whatever order groups ran in.
 *
 * Never an out-of-bounds read, whatever the tables hold (the host refuses bad tables before
 * launching, paged_attention.check_tables; this is the second line): lengths are clamped to
 * [0, MB*BS], a block id to [0, NB), and only pages below the length are touched.
 *
 * Non-finite values, as attention.semantics: scale folded into q; a key whose V row holds a
 * NaN or an inf makes every row that may attend it NaN (the row's sum becomes NaN; V enters
 * with those entries zeroed); a NaN or +inf score makes its row NaN through exp(s - m); a row
 * is dead (writes 0) only when its max is -inf and its sum exactly 0.
 *
 * Two paths, one source. CPU schedule (PA_VEC: WG = 1, OpenCL vectors, fp32 compute): the
 * item keeps its rows' scaled q as VEC-wide vectors and takes each page in chunks of VEC
 * keys. Q.K^T is register-blocked (two keys against every row: each K vector is loaded and
 * converted once and used RB times), the VEC dot products per row come out of one
 * transpose-and-add tree, then one max, a rescale only when the max rises, and one vector
 * exp per row and chunk. P.V is register-blocked too (PA_CG accumulator vectors of every row
 * stay in registers while the chunk's V rows stream past). The next chunk's K and V rows
 * are prefetched (PK_PREFETCH_ONCE: read once, kept out of the way) a row at a time inside
 * this chunk's loops: the pages sit wherever the block table puts them, so the hardware
 * prefetcher cannot see them coming; without it the kernel pays the memory's latency once
 * per page on top of its arithmetic, and with a whole page requested at once it stalls
 * until the miss buffers drain.
 * GPU schedule (scalar, any WG): tiles of WG keys; item j scores key j for every row into
 * local memory, items r < RB update row r's max and sum, then every item accumulates its
 * (row, d) outputs over the tile.
 */
#define DQ_ (DQ > 0 ? DQ : 1)
#define DV_ (DV > 0 ? DV : 1)
#define PA_VEC (VEC > 1 && PK_HAS_VECTOR && PK_ACC_IS_FLOAT_T && WG == 1 && DQ % VEC == 0 \
                && DV % VEC == 0 && DQ > 0 && DV > 0)
#define PA_NAN ((PK_ACC_T)PK_INFINITY - (PK_ACC_T)PK_INFINITY)
#define PA_FINITE(x) ((x) - (x) == (PK_ACC_T)0)
#define PA_OPI ((RB * DV_ + WG - 1) / WG) /* outputs per item, scalar path */
PK_DEVICE_FN int pa_clamp(int x, int hi) { return x < 0 ? 0 : (x > hi ? hi : x); }

/* (inside the kernel: mods, bs3, wl, wr, cap in scope; attention_mods.c) */
#define PA_BIAS_AT(brow, kp) \
    (AT_HAS(AT_BIT_BIAS) ? PK_LOAD_T(BIAS, (brow) + (kp) * bs3) : (PK_ACC_T)0)
#define PA_SCORE(s, brow, qp, kp, slope) \
    (AT_HAS_MOD ? at_modify((s), PA_BIAS_AT(brow, kp), (slope), (qp), (kp), cap, mods) : (s))
#define PA_AT_OR_BEFORE(kp, qp) ((kp) <= (qp)) /* scalars or int vectors */
#define PA_KEEP(qp, kp) (PA_AT_OR_BEFORE(kp, qp) && (!AT_HAS(AT_BIT_WIN) || at_in_window((qp), (kp), wl, wr)))

#if PA_VEC
typedef PK_CAT(float, VEC) pa_vt;
typedef PK_CAT(int, VEC) pa_it;
#if VEC == 16
#define PA_LANES (pa_it)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#elif VEC == 8
#define PA_LANES (pa_it)(0, 1, 2, 3, 4, 5, 6, 7)
#else
#define PA_LANES (pa_it)(0, 1, 2, 3)
#endif
/* VEC consecutive storage elements at p as a float vector */
#if PA_ST == 1
#define PA_VLOAD(p) PK_CAT(vload_half, VEC)(0, (p))
#elif PA_ST == 2
#define PA_VLOAD(p) PK_CAT(as_float, VEC)(PK_CAT(convert_uint, VEC)( \
    PK_CAT(vload, VEC)(0, (PK_GLOBAL const unsigned short*)(p))) << 16)
#else
#define PA_VLOAD(p) PK_CAT(vload, VEC)(0, (p))
#endif
/* lane reductions as halvings (.lo/.hi): shuffles the compiler keeps in registers */
#if VEC == 16
/* (the halves of a 16-lane vector through shuffle, not .lo/.hi: Oclgrind 21.10 reads the
 * shadow of a 16-lane .hi from the wrong operand and reports every lane uninitialised) */
#define PA_LO16(v) shuffle((v), (uint8)(0, 1, 2, 3, 4, 5, 6, 7))
#define PA_HI16(v) shuffle((v), (uint8)(8, 9, 10, 11, 12, 13, 14, 15))
#define PA_HSUM(v) pa_hsum8(PA_LO16(v) + PA_HI16(v))
#define PA_HMAX(v) pa_hmax8(fmax(PA_LO16(v), PA_HI16(v)))
#elif VEC == 8
#define PA_HSUM(v) pa_hsum8(v)
#define PA_HMAX(v) pa_hmax8(v)
#else
#define PA_HSUM(v) pa_hsum4(v)
#define PA_HMAX(v) pa_hmax4(v)
#endif
/* (the last step through dot: a scalar a.x + a.y is vectorised by LLVM into a shuffle with an
 * undefined lane, on which Oclgrind 21.10 crashes or misreports) */
PK_DEVICE_FN float pa_hsum4(float4 v) { return dot(v.lo + v.hi, (float2)(1.0f)); }
PK_DEVICE_FN float pa_hmax4(float4 v) { const float2 a = fmax(v.lo, v.hi); return fmax(a.x, a.y); }
PK_DEVICE_FN float pa_hsum8(float8 v) { return pa_hsum4(v.lo + v.hi); }
PK_DEVICE_FN float pa_hmax8(float8 v) { return pa_hmax4(fmax(v.lo, v.hi)); }
/* PA_DOTS(p): the VEC lane sums of p[0..VEC-1] as one vector, lane j = sum of p[j]. A
 * transpose-and-add tree: each stage adds two shuffles of a pair of vectors, halving the
 * partials per key and doubling the keys per vector (VEC - 1 vector adds in all, against VEC
 * separate reductions and lane inserts). Written with shuffle2 and constant masks, not
 * swizzle concatenations such as (float4)(a.s01, b.s23): those leave shuffles with undefined
 * lanes in the IR, even unoptimised, on which Oclgrind 21.10's uninitialised-value plugin
 * crashes; PoCL and Intel compile either form to the same permutes. */
#if VEC == 16
#define PA_SH(a, b, ...) shuffle2((a), (b), (uint16)(__VA_ARGS__))
#define PA_T1(a, b) (PA_SH(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) \
                     + PA_SH(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define PA_T2(a, b) (PA_SH(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) \
                     + PA_SH(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define PA_T3(a, b) (PA_SH(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) \
                     + PA_SH(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define PA_T4(a, b) (PA_SH(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) \
                     + PA_SH(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
#define PA_Q8(p, o) PA_T2(PA_T1(p[o], p[o + 1]), PA_T1(p[o + 2], p[o + 3]))
#define PA_DOTS(p) PA_T4(PA_T3(PA_Q8(p, 0), PA_Q8(p, 4)), PA_T3(PA_Q8(p, 8), PA_Q8(p, 12)))
#elif VEC == 8
#define PA_SH(a, b, ...) shuffle2((a), (b), (uint8)(__VA_ARGS__))
#define PA_T1(a, b) (PA_SH(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + PA_SH(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
#define PA_T2(a, b) (PA_SH(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + PA_SH(a, b, 2, 3, 6, 7, 10, 11, 14, 15))
#define PA_T3(a, b) (PA_SH(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + PA_SH(a, b, 1, 3, 5, 7, 9, 11, 13, 15))
#define PA_DOTS(p) PA_T3(PA_T2(PA_T1(p[0], p[1]), PA_T1(p[2], p[3])), \
                         PA_T2(PA_T1(p[4], p[5]), PA_T1(p[6], p[7])))
#else
#define PA_SH(a, b, ...) shuffle2((a), (b), (uint4)(__VA_ARGS__))
#define PA_T1(a, b) (PA_SH(a, b, 0, 1, 4, 5) + PA_SH(a, b, 2, 3, 6, 7))
#define PA_T2(a, b) (PA_SH(a, b, 0, 2, 4, 6) + PA_SH(a, b, 1, 3, 5, 7))
#define PA_DOTS(p) PA_T2(PA_T1(p[0], p[1]), PA_T1(p[2], p[3]))
#endif
#define NQV (DQ / VEC)
#define PA_ESZ (PA_ST ? 2 : 4) /* bytes per stored element */
/* the next chunk's hint (tunable PF): 0 non-temporal (PK_PREFETCH_ONCE: prefetchnta, the
 * best measured on an AVX2 Zen), 1 into the outer caches (PK_PREFETCH_OUTER: prefetcht2,
 * 1.5-1.9x faster than prefetchnta on an AVX-512 Zen 4, where prefetchnta and prefetcht0
 * measured alike) */
#if PF == 1
#define PA_PF(p) PK_PREFETCH_OUTER(p)
#else
#define PA_PF(p) PK_PREFETCH_ONCE(p)
#endif
/* every cache line of the `n` bytes at p (n a constant: unrolled) */
#define PA_PREFETCH_ROW(p, n) do { \
        _Pragma("unroll") for (int pf_ = 0; pf_ < (n); pf_ += 64) PA_PF((p) + pf_); \
        PA_PF((p) + (n) - 1); \
    } while (0)
/* accumulator vectors per row held in registers through P.V: RB * PA_CG <= ACC (at least
 * one per row: ACC < RB gives RB), the schedule's register budget (AVX-512's 32 zmm: 16; AVX2's 16 ymm: 8 — beside them each
 * step holds a V vector and the rows' weights, and an accumulator that does not fit goes
 * through the stack on every key) */
/* keys a chunk takes from each of its PAGES pages (tunable PAGES: the chunk's VEC keys are
 * PA_KPP consecutive slots of PAGES consecutive pages of the table, read side by side) */
#define PA_PAGES (PAGES < VEC ? (PAGES > 0 ? PAGES : 1) : VEC) /* a chunk spans <= VEC pages */
#define PA_KPP (VEC / PA_PAGES)
/* rw[j] = the row (in pages of Hkv * BS rows) of lane j's key in the chunk at slot s0 of the
 * group of pages from gp; a lane past its page's keys, or past the split's pages, gets lane
 * 0's row (lane 0's key always exists). One block-table read per page of the group, none
 * for a page past the split (a lookup per lane cost up to 13% in cache, under load). (In the
 * kernel: b, L, p_hi in scope; hd the kv head.) */
#define PA_ROWS(rw, gp, s0, hd) do { \
        const int r0_ = (PA_BLOCK(gp) * Hkv + (hd)) * BS + (s0); \
        _Pragma("unroll") for (int u_ = 0; u_ < PA_PAGES; ++u_) { \
            const int pu_ = (gp) + u_; \
            const int nku_ = pu_ < p_hi ? min(BS, L - pu_ * BS) : 0; /* the page's keys */ \
            const int base_ = u_ == 0 ? r0_ - (s0) \
                              : (nku_ > 0 ? (PA_BLOCK(pu_) * Hkv + (hd)) * BS : 0); \
            _Pragma("unroll") for (int l_ = 0; l_ < PA_KPP; ++l_) \
                rw[u_ * PA_KPP + l_] = (s0) + l_ < nku_ ? base_ + (s0) + l_ : r0_; \
        } \
    } while (0)
#define PA_CG (ACC / RB < NAV ? (ACC / RB > 0 ? ACC / RB : 1) : NAV)
#define NAV (DV / VEC)
#endif

PK_KERNEL void paged_attention(PK_GLOBAL const PK_T_T* PK_RESTRICT Q,
                               PK_GLOBAL const PK_T_T* PK_RESTRICT KC,
                               PK_GLOBAL const PK_T_T* PK_RESTRICT VC,
                               PK_GLOBAL const int* PK_RESTRICT BT,
                               PK_GLOBAL const int* PK_RESTRICT SL,
                               PK_GLOBAL const PK_T_T* PK_RESTRICT BIAS,
                               PK_GLOBAL const float* PK_RESTRICT SLOPES,
                               PK_GLOBAL PK_T_T* PK_RESTRICT O,
                               PK_GLOBAL PK_ACC_T* PK_RESTRICT PM,
                               PK_GLOBAL PK_ACC_T* PK_RESTRICT PL,
                               PK_GLOBAL PK_ACC_T* PK_RESTRICT PA,
                               int Sq, int Hq, int Hkv, int NB, int BS, int MB, int nrb,
                               int nsplit, int pps, int nrows, PK_ACC_T scale, int wl, int wr,
                               PK_ACC_T cap, int mods, int bs0, int bs1, int bs2, int bs3)
{
    /* (no `%` beside a `/`: LLVM pairs them behind a `freeze` Oclgrind 21.10 cannot run) */
    const int g = PK_GROUP_ID(0);
    const int rest = g / nsplit;
    const int s = g - rest * nsplit;
    const int bk = rest / nrb;
    const int rb = rest - bk * nrb;
    const int nhg = (Hkv + HEADS - 1) / HEADS; /* groups of heads per sequence */
    const int b = bk / nhg;
    const int kvh0 = (bk - b * nhg) * HEADS; /* the group's first kv head */
    const int nh = HEADS == 1 ? 1 : min(HEADS, Hkv - kvh0); /* its heads */
    int kvh = kvh0;
    const int G = Hq / Hkv;
    const int R = G * Sq; /* rows of this kv head */
    const int lid = PK_LOCAL_ID(0);
    const int cap_len = MB * BS;
    int L = SL[b];
    L = L < 0 ? 0 : (L > cap_len ? cap_len : L);
    const int q0pos = L - Sq; /* position of query 0 */
    /* this split's pages, below the length, and (window) not wholly left of every query */
    int p_lo = s * pps;
    const int p_hi = min(p_lo + pps, (L + BS - 1) / BS);
    if (AT_HAS(AT_BIT_WIN)) p_lo = max(p_lo, max(0, q0pos - wl) / BS);
    /* row r of the block: query head kvh * G + rr / Sq, query rr % Sq (rr = rb * RB + r) */
#define PA_ROW_OK(r) (rb * RB + (r) < R)
#define PA_QH0(r) ((rb * RB + (r)) / Sq)
#define PA_QH(r) (kvh * G + PA_QH0(r))
#define PA_QI(r) ((rb * RB + (r)) - PA_QH0(r) * Sq)
#define PA_OROW(r) ((b * Hq + PA_QH(r)) * Sq + PA_QI(r)) /* output row index */
#define PA_BROW(r) (b * bs0 + PA_QH(r) * bs1 + PA_QI(r) * bs2)
#define PA_BLOCK(pg) pa_clamp(BT[b * MB + (pg)], NB - 1)

#if PA_VEC
    /* per head of the group: its rows' scaled q, accumulators, max, sum */
    pa_vt qv[HEADS][RB][NQV];
    pa_vt acc[HEADS][RB][NAV];
    float m[HEADS][RB], l[HEADS][RB], slope[HEADS][RB];
    int qpos[RB], brow[HEADS][RB], poison[HEADS][RB];
    for (int hh = 0; hh < nh; ++hh) {
        kvh = kvh0 + hh;
        #pragma unroll
        for (int r = 0; r < RB; ++r) {
            const int ok = PA_ROW_OK(r);
            const int qrow = ok ? PA_OROW(r) : 0;
            #pragma unroll
            for (int c = 0; c < NQV; ++c)
                qv[hh][r][c] = ok ? PA_VLOAD(Q + qrow * DQ + c * VEC) * (pa_vt)(scale)
                                  : (pa_vt)(0.0f);
            #pragma unroll
            for (int c = 0; c < NAV; ++c) acc[hh][r][c] = (pa_vt)(0.0f);
            m[hh][r] = -PK_INFINITY;
            l[hh][r] = 0.0f;
            qpos[r] = ok ? q0pos + PA_QI(r) : -1; /* a row past R keeps no key */
            brow[hh][r] = ok ? PA_BROW(r) : 0;
            poison[hh][r] = 0;
            slope[hh][r] = ok && AT_HAS(AT_BIT_ALIBI) ? SLOPES[PA_QH(r)] : 0.0f;
        }
    }
    const pa_it lanes = PA_LANES;
    /* lane j of a chunk: page lpage[j] of its group of pages, slot t0 + lslot[j] */
    const pa_it lpage = lanes / (pa_it)(PA_KPP);
    const pa_it lslot = lanes - lpage * (pa_it)(PA_KPP);
    for (int pg = p_lo; pg < p_hi; pg += PA_PAGES) {
      const int nk0 = min(BS, L - pg * BS); /* keys of the group's first page: the most */
      for (int hh = 0; hh < nh; ++hh) { /* the page group for each head in turn */
        kvh = kvh0 + hh;
        for (int t0 = 0; t0 < nk0; t0 += PA_KPP) {
            /* The chunk's row of every lane (a lane past its page's keys reads lane 0's row
             * again, in bounds; its score is masked below), and the next chunk's (this
             * group's next slots, else the next group's first) to prefetch. */
            int nt0 = t0 + PA_KPP, npg = pg, nkvh = kvh;
            if (nt0 >= nk0) { /* the next head's first chunk, else the next group's */
                nt0 = 0;
                if (hh + 1 < nh) nkvh = kvh + 1;
                else { nkvh = kvh0; npg = pg + PA_PAGES; }
            }
            const int has_next = npg < p_hi;
#if PA_PAGES == 1
            /* one page: the chunk's rows are consecutive from slot t0 (no row table: it cost
             * 4-13% in cache, measured under load), lanes past the page's last key on that key */
            const int rbase = (PA_BLOCK(pg) * Hkv + kvh) * BS + t0, nk = nk0 - t0;
            const int nbase = has_next ? (PA_BLOCK(npg) * Hkv + nkvh) * BS + nt0 : 0;
            const int nnk = has_next ? min(BS, L - npg * BS) - nt0 : 1;
#define PA_ROW(j) (rbase + min((j), nk - 1))
#define PA_NROW(j) (nbase + min((j), nnk - 1))
#else
            int row[VEC], nrow[VEC];
            PA_ROWS(row, pg, t0, kvh);
            if (has_next) PA_ROWS(nrow, npg, nt0, nkvh);
#define PA_ROW(j) row[j]
#define PA_NROW(j) nrow[j]
#endif
            /* Q.K^T, register-blocked: two keys at a time against every row, each K vector
             * loaded (converted) once and used RB times from a register. */
            pa_vt part[RB][VEC];
            #pragma unroll 1
            for (int j = 0; j < VEC; j += 2) {
                const int r0 = PA_ROW(j), r1 = PA_ROW(j + 1);
                if (has_next) {
                    PA_PREFETCH_ROW((const PK_GLOBAL char*)(KC + PA_NROW(j) * DQ), DQ * PA_ESZ);
                    PA_PREFETCH_ROW((const PK_GLOBAL char*)(KC + PA_NROW(j + 1) * DQ),
                                    DQ * PA_ESZ);
                }
                pa_vt s0[RB], s1[RB];
                #pragma unroll
                for (int r = 0; r < RB; ++r) {
                    s0[r] = (pa_vt)(0.0f);
                    s1[r] = (pa_vt)(0.0f);
                }
                #pragma unroll
                for (int c = 0; c < NQV; ++c) {
                    const pa_vt k0 = PA_VLOAD(KC + r0 * DQ + c * VEC);
                    const pa_vt k1 = PA_VLOAD(KC + r1 * DQ + c * VEC);
                    #pragma unroll
                    for (int r = 0; r < RB; ++r) {
                        s0[r] = fma(qv[hh][r][c], k0, s0[r]);
                        s1[r] = fma(qv[hh][r][c], k1, s1[r]);
                    }
                }
                #pragma unroll
                for (int r = 0; r < RB; ++r) {
                    part[r][j] = s0[r];
                    part[r][j + 1] = s1[r];
                }
            }
            const pa_it kposv = (pa_it)(pg * BS + t0) + lpage * (pa_it)(BS) + lslot;
            /* (a lane past its page's slots would read as the next page's position, which
             * causal alone would keep; a lane of a page past the split's end, as a key of the
             * next split.) Each term only where it can be false: with one slot a page, or one
             * page a chunk, it compares a constant, and Oclgrind 21.10 runs that splat wrong. */
            pa_it live = kposv < (pa_it)(L);
#if PA_KPP > 1
            live &= lslot < (pa_it)(BS - t0);
#endif
#if PA_PAGES > 1
            live &= lpage < (pa_it)(p_hi - pg);
#endif
            pa_vt wv[RB]; /* the chunk's weights per row, lane j = key t0 + j */
            #pragma unroll
            for (int r = 0; r < RB; ++r) {
                /* the VEC dot products, lane j = key t0 + j: a transpose-and-add tree */
                const pa_vt dots = PA_DOTS(part[r]);
                pa_vt sv;
                if (AT_HAS_MOD || AT_HAS(AT_BIT_WIN)) { /* modifiers, a window: lane by lane */
                    const float* dj = (const float*)&dots;
                    const int* kpj = (const int*)&kposv;
                    const int* lvj = (const int*)&live;
                    sv = (pa_vt)(-PK_INFINITY);
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const int kpos = kpj[j];
                        if (lvj[j] && PA_KEEP(qpos[r], kpos))
                            sv = select(sv, (pa_vt)(PA_SCORE(dj[j], brow[hh][r], qpos[r], kpos,
                                                             slope[hh][r])), lanes == (pa_it)(j));
                    }
                } else {
                    sv = select((pa_vt)(-PK_INFINITY), dots,
                                live & PA_AT_OR_BEFORE(kposv, (pa_it)(qpos[r])));
                }
                /* The chunk's max; rescale only when it rises (the factor would be exactly
                 * 1 otherwise: the same sums, fewer operations). */
                const float mc = PA_HMAX(sv);
                if (mc > m[hh][r]) {
                    /* the rescale through the vector exp too (a libm call costs more) */
                    const float corr = m[hh][r] == -PK_INFINITY ? 0.0f
                                       : PK_VEXP((pa_vt)(m[hh][r] - mc)).s0;
                    l[hh][r] *= corr;
                    #pragma unroll
                    for (int c = 0; c < NAV; ++c) acc[hh][r][c] *= (pa_vt)(corr);
                    m[hh][r] = mc;
                }
                const float shift = (m[hh][r] == -PK_INFINITY) ? 0.0f : m[hh][r];
                wv[r] = PK_VEXP(sv - (pa_vt)(shift));
                l[hh][r] += PA_HSUM(wv[r]);
            }
            /* P.V, register-blocked: PA_CG accumulator vectors of every row stay in registers
             * while the chunk's keys stream past, so each V vector is loaded (converted) once
             * and used RB times. A V row holding a NaN or an inf (rare) is redone lane-exactly:
             * its entries zeroed, the rows that keep its key poisoned. */
            const float* w = (const float*)wv;
            #pragma unroll
            for (int c0 = 0; c0 < NAV; c0 += PA_CG) {
                pa_vt a[RB][PA_CG];
                pa_vt bad = (pa_vt)(0.0f);
                #pragma unroll
                for (int r = 0; r < RB; ++r)
                    #pragma unroll
                    for (int i = 0; i < PA_CG; ++i)
                        if (c0 + i < NAV) a[r][i] = acc[hh][r][c0 + i];
                #pragma unroll 1
                for (int j = 0; j < VEC; ++j) {
                    const int rj = PA_ROW(j);
                    if (c0 == 0 && has_next)
                        PA_PREFETCH_ROW((const PK_GLOBAL char*)(VC + PA_NROW(j) * DV), DV * PA_ESZ);
                    #pragma unroll
                    for (int i = 0; i < PA_CG; ++i) {
                        if (c0 + i < NAV) {
                            const pa_vt x = PA_VLOAD(VC + rj * DV + (c0 + i) * VEC);
                            #pragma unroll
                            for (int r = 0; r < RB; ++r)
                                a[r][i] = fma((pa_vt)(w[r * VEC + j]), x, a[r][i]);
                        }
                    }
                }
                /* A non-finite entry in the chunk's V rows leaves a non-finite accumulator
                 * whatever its weight (w * inf is inf, 0 * inf NaN, and neither leaves), so
                 * one check per accumulator after the chunk finds it, not one per V vector:
                 * their sum, non-finite if any one is (an add, off the FMA pipes, where
                 * a * 0 took an FMA per accumulator: 2-5% of the decode on a Zen). An
                 * overflow of the sum or a NaN weight takes the exact path too, which gives
                 * the same value. */
                #pragma unroll
                for (int r = 0; r < RB; ++r)
                    #pragma unroll
                    for (int i = 0; i < PA_CG; ++i)
                        if (c0 + i < NAV) bad += a[r][i];
                if (!all(isequal(bad - bad, (pa_vt)(0.0f)))) {
                    /* from the chunk's start again, exactly: bad entries zeroed, the rows
                     * that keep a bad row's key poisoned */
                    #pragma unroll
                    for (int r = 0; r < RB; ++r)
                        #pragma unroll
                        for (int i = 0; i < PA_CG; ++i)
                            if (c0 + i < NAV) a[r][i] = acc[hh][r][c0 + i];
                    const int* kpj = (const int*)&kposv;
                    const int* lvj = (const int*)&live;
                    for (int j = 0; j < VEC; ++j) { /* a dead lane weighs 0: adds 0 */
                        int vbad = 0;
                        #pragma unroll
                        for (int i = 0; i < PA_CG; ++i) {
                            if (c0 + i < NAV) {
                                const pa_vt x = PA_VLOAD(VC + PA_ROW(j) * DV + (c0 + i) * VEC);
                                const pa_it ok = isequal(x - x, (pa_vt)(0.0f));
                                vbad |= !all(ok);
                                const pa_vt xz = select((pa_vt)(0.0f), x, ok);
                                #pragma unroll
                                for (int r = 0; r < RB; ++r)
                                    a[r][i] = fma((pa_vt)(w[r * VEC + j]), xz, a[r][i]);
                            }
                        }
                        if (vbad && lvj[j])
                            #pragma unroll
                            for (int r = 0; r < RB; ++r)
                                poison[hh][r] |= PA_KEEP(qpos[r], kpj[j]);
                    }
                }
                #pragma unroll
                for (int r = 0; r < RB; ++r)
                    #pragma unroll
                    for (int i = 0; i < PA_CG; ++i)
                        if (c0 + i < NAV) acc[hh][r][c0 + i] = a[r][i];
            }
        }
      }
    }
    for (int hh = 0; hh < nh; ++hh) {
        kvh = kvh0 + hh;
        #pragma unroll
        for (int r = 0; r < RB; ++r) {
            if (!PA_ROW_OK(r)) continue;
            const int orow = PA_OROW(r);
            /* a kept key's bad V row: NaN row */
            const float lr = poison[hh][r] ? PA_NAN : l[hh][r];
#if PA_SPLIT
            PM[s * nrows + orow] = m[hh][r];
            PL[s * nrows + orow] = lr;
            for (int c = 0; c < NAV; ++c)
                PK_CAT(vstore, VEC)(acc[hh][r][c], 0, PA + (s * nrows + orow) * DV + c * VEC);
#else
            for (int c = 0; c < NAV; ++c) {
                const pa_vt o = (lr == 0.0f) ? (pa_vt)(0.0f) : acc[hh][r][c] / (pa_vt)(lr);
                for (int i = 0; i < VEC; ++i)
                    PK_STORE_T(O, orow * DV + c * VEC + i, ((float*)&o)[i]);
            }
#endif
        }
    }
#else /* scalar path */
    PK_LOCAL PK_ACC_T Qs[RB][DQ_]; /* scaled queries */
    PK_LOCAL PK_ACC_T Ss[RB][WG];  /* a tile's scores, then weights */
    PK_LOCAL PK_ACC_T Ms[RB], Ls[RB], Cs[RB];
    PK_ACC_T acc[PA_OPI];
    for (int hh = 0; hh < nh; ++hh) { /* the group's heads one after another */
    kvh = kvh0 + hh;
    for (int t = 0; t < PA_OPI; ++t) acc[t] = (PK_ACC_T)0;
    for (int idx = lid; idx < RB * DQ; idx += WG) {
        const int r = idx / DQ_, d = idx - (idx / DQ_) * DQ_;
        Qs[r][d] = PA_ROW_OK(r) ? PK_LOAD_T(Q, PA_OROW(r) * DQ + d) * scale : (PK_ACC_T)0;
    }
    for (int r = lid; r < RB; r += WG) {
        Ms[r] = -PK_INFINITY;
        Ls[r] = (PK_ACC_T)0;
        Cs[r] = (PK_ACC_T)0;
    }
    PK_BARRIER();
    const int k_lo = p_lo * BS;
    const int k_hi = min(p_hi * BS, L);
    for (int k0 = k_lo; k0 < k_hi; k0 += WG) {
        const int kpos = k0 + lid;
        if (kpos < k_hi) {
            const int pg = kpos / BS;
            const int slot = kpos - pg * BS;
            const int row = (PA_BLOCK(pg) * Hkv + kvh) * BS + slot;
            int vbad = 0;
            for (int d = 0; d < DV; ++d) vbad |= !PA_FINITE(PK_LOAD_T(VC, row * DV + d));
            for (int r = 0; r < RB; ++r) {
                const int qp = q0pos + PA_QI(r);
                PK_ACC_T sc = -PK_INFINITY;
                if (PA_ROW_OK(r) && PA_KEEP(qp, kpos)) {
                    PK_ACC_T dot = (PK_ACC_T)0;
                    for (int d = 0; d < DQ; ++d) dot += Qs[r][d] * PK_LOAD_T(KC, row * DQ + d);
                    const PK_ACC_T slope =
                        AT_HAS(AT_BIT_ALIBI) ? (PK_ACC_T)SLOPES[PA_QH(r)] : (PK_ACC_T)0;
                    sc = vbad ? PA_NAN : PA_SCORE(dot, PA_BROW(r), qp, kpos, slope);
                }
                Ss[r][lid] = sc;
            }
        } else {
            for (int r = 0; r < RB; ++r) Ss[r][lid] = -PK_INFINITY;
        }
        PK_BARRIER();
        for (int r = lid; r < RB; r += WG) {
            PK_ACC_T mt = -PK_INFINITY;
            for (int j = 0; j < WG; ++j) mt = fmax(mt, Ss[r][j]);
            const PK_ACC_T mn = fmax(Ms[r], mt);
            const PK_ACC_T shift = (mn == -PK_INFINITY) ? (PK_ACC_T)0 : mn;
            PK_ACC_T sum = (PK_ACC_T)0;
            for (int j = 0; j < WG; ++j) {
                const PK_ACC_T e = exp(Ss[r][j] - shift);
                Ss[r][j] = e;
                sum += e;
            }
            Cs[r] = exp(Ms[r] - shift);
            Ls[r] = Ls[r] * Cs[r] + sum;
            Ms[r] = mn;
        }
        PK_BARRIER();
        const int nk = min(WG, k_hi - k0);
#if PA_OPI <= 16
        #pragma unroll
#endif
        for (int t = 0; t < PA_OPI; ++t) {
            const int o = lid + t * WG;
            if (o < RB * DV) {
                const int r = o / DV_, d = o - (o / DV_) * DV_;
                PK_ACC_T a = acc[t] * Cs[r];
                for (int j = 0; j < nk; ++j) {
                    const int kp = k0 + j;
                    const int pg = kp / BS;
                    const int row = (PA_BLOCK(pg) * Hkv + kvh) * BS + (kp - pg * BS);
                    const PK_ACC_T x = PK_LOAD_T(VC, row * DV + d);
                    a += Ss[r][j] * (PA_FINITE(x) ? x : (PK_ACC_T)0);
                }
                acc[t] = a;
            }
        }
        PK_BARRIER();
    }
#if PA_SPLIT
    for (int r = lid; r < RB; r += WG) {
        if (PA_ROW_OK(r)) {
            PM[s * nrows + PA_OROW(r)] = Ms[r];
            PL[s * nrows + PA_OROW(r)] = Ls[r];
        }
    }
#endif
#if PA_OPI <= 16 /* registers on a GPU; a CPU item (WG = 1) keeps RB * DV in memory */
    #pragma unroll
#endif
    for (int t = 0; t < PA_OPI; ++t) {
        const int o = lid + t * WG;
        if (o < RB * DV) {
            const int r = o / DV_, d = o - (o / DV_) * DV_;
            if (PA_ROW_OK(r)) {
#if PA_SPLIT
                PA[(s * nrows + PA_OROW(r)) * DV + d] = acc[t];
#else
                const PK_ACC_T lr = Ls[r];
                PK_STORE_T(O, PA_OROW(r) * DV + d, (lr == (PK_ACC_T)0) ? (PK_ACC_T)0 : acc[t] / lr);
#endif
            }
        }
    }
    PK_BARRIER(); /* (the next head overwrites Qs, Ms, Ls) */
    }
#endif
}

/* O[row][d] from the splits' partials, in split order: M = max_s PM, weights exp(PM - M)
 * (a split that kept no key, PM = -inf, weighs 0), L = sum PL w, O = sum PA w / L, 0 when
 * L = 0 (a dead row). NaN in a split's PL (a NaN score, a bad V row) makes the row NaN. */
PK_KERNEL void paged_attention_combine(PK_GLOBAL const PK_ACC_T* PK_RESTRICT PM,
                                       PK_GLOBAL const PK_ACC_T* PK_RESTRICT PL,
                                       PK_GLOBAL const PK_ACC_T* PK_RESTRICT PA,
                                       PK_GLOBAL PK_T_T* PK_RESTRICT O, int nrows, int nsplit)
{
    const int gid = PK_GROUP_ID(0) * PK_LOCAL_SIZE(0) + PK_LOCAL_ID(0);
    if (gid >= nrows * DV) return;
    const int row = gid / DV_;
    const int d = gid - row * DV_;
    PK_ACC_T mx = -PK_INFINITY;
    for (int s = 0; s < nsplit; ++s) mx = fmax(mx, PM[s * nrows + row]);
    const PK_ACC_T shift = (mx == -PK_INFINITY) ? (PK_ACC_T)0 : mx;
    PK_ACC_T lt = (PK_ACC_T)0, a = (PK_ACC_T)0;
    for (int s = 0; s < nsplit; ++s) {
        const PK_ACC_T w = exp(PM[s * nrows + row] - shift);
        lt += PL[s * nrows + row] * w;
        a += PA[(s * nrows + row) * DV + d] * w;
    }
    PK_STORE_T(O, row * DV + d, (lt == (PK_ACC_T)0) ? (PK_ACC_T)0 : a / lt);
}

/* Y = softmax(X) along one axis. X viewed as (outer, n, inner): element (o, j, i) sits at
 * (o*n + j)*inner + i, so any axis is a strided row and no transpose is ever made.
 *
 * One work-group per row, one read pass for the statistics: each item keeps an online
 * (running max m, running sum s of exp(x - m)) pair over its strided elements, pairs are
 * merged by a tree in local memory, then one pass writes exp(x - m) / s. Stable for any offset;
 * a row of only -inf gives 0 (as a fully masked attention row does); NaN propagates, and so
 * does +inf (exp(inf - inf) is NaN: the row is NaN, as in the oracle).
 *
 * CPU schedule (STORE_EXP): three passes over a row that stays in cache. Where the output is
 * larger than the caches (STREAM=1, chosen by size), the exp pass keeps e in a local row (up
 * to 4096 floats; a longer row computes exp again in the scale pass) instead of y, and the
 * scale pass writes y with streaming stores: y is written once and no line of it is read for
 * ownership, a third less memory traffic.
 *
 * Long rows are summed in blocks: each item's (or lane's) sum takes SBLK terms into a block
 * partial before adding it to its running sum, so a 10^6-element row's sum errs by ~1e-7
 * relative, not ~1e-5 (one running sum over 62,500 terms per lane).
 */
#define SBLK 64 /* terms (vectors on the vector paths) per block partial sum */
/* the next row's hint (tunable PF): 1 into the outer caches (prefetcht2: 11-14% faster on an
 * AVX-512 Zen 4), 0 into L1 (prefetcht0) */
#if PF == 1
#define SM_PF(p) PK_PREFETCH_OUTER(p)
#else
#define SM_PF(p) PK_PREFETCH(p)
#endif
#define SM_SCR_BYTES 16384 /* STREAM=1: the row of e kept in local memory, at most */
#if STREAM == 1
#define SM_KEEP(i, v) (scr[(i)] = (v))
#define SM_KEPT(i) scr[(i)]
#else
#define SM_KEEP(i, v) ((void)0)
#define SM_KEPT(i) ((PK_CAT(PK_ACC_T, VEC))(0))
#endif
#if VEC > 1 && PK_HAS_VECTOR
/* x > m ? x : m lane by lane: one x86 maxps, where fmax's NaN rule costs a compare and a
 * blend more. A NaN x is dropped here as fmax drops it: it turns the row NaN in pass 2, or,
 * when every other value is -inf, through the check after the max pass. */
PK_DEVICE_FN PK_CAT(PK_ACC_T, VEC) sm_vmax(PK_CAT(PK_ACC_T, VEC) m, PK_CAT(PK_ACC_T, VEC) x)
{
    return select(m, x, x > m);
}
#endif
PK_DEVICE_FN void pk_merge(PK_ACC_T* m, PK_ACC_T* s, PK_ACC_T m2, PK_ACC_T s2)
{
    const PK_ACC_T m1 = *m;
    const PK_ACC_T mx = (m2 > m1 || m2 != m2) ? m2 : m1;
    if (mx == -PK_INFINITY) { *s = (PK_ACC_T)0; return; }
    *s = *s * exp(m1 - mx) + s2 * exp(m2 - mx);
    *m = mx;
}


PK_KERNEL void softmax(PK_GLOBAL const PK_T_T* PK_RESTRICT X, PK_GLOBAL PK_T_T* PK_RESTRICT Y,
                       int n, int inner)
{
    const int row = PK_GROUP_ID(0);
    const int lid = PK_LOCAL_ID(0);
    const int o = row / inner;
    const int base = o * n * inner + (row - o * inner);

    PK_LOCAL PK_ACC_T lm[WG];
    PK_LOCAL PK_ACC_T ls[WG];
#if STORE_EXP && PK_PLAIN_T && STREAM == 1 && VEC > 1 && PK_HAS_VECTOR
    /* the streamed path's row of e (16 KiB: 4096 floats), kept in cache for the scale pass
     * so that exp runs once; a longer row computes exp again there */
    PK_LOCAL PK_CAT(PK_ACC_T, VEC) scr[SM_SCR_BYTES / (VEC * sizeof(PK_ACC_T))];
#endif

#if STORE_EXP && PK_PLAIN_T
    /* STORE_EXP=1 (CPU schedule, fp32/fp64 storage): exp once per element. Pass 1 finds the
     * row max (no exp), pass 2 writes e = exp(x - max) into Y and sums it, pass 3 scales Y in
     * place; a row is small enough to stay in cache between passes. The one-read online path
     * below computes exp twice per element, which a CPU pays for in exp, not in memory. fp16/
     * bf16 storage keeps that path: storing e rounded and scaling it would round twice. */
    {
        PK_ACC_T mx = -PK_INFINITY;
        int j1 = lid;
#if VEC > 1 && PK_HAS_VECTOR
        typedef PK_CAT(PK_ACC_T, VEC) svt;
        const int nv = (inner == 1) ? n / VEC : 0;
        const PK_GLOBAL PK_T_T* xr = X + base;
        PK_GLOBAL PK_T_T* yr = Y + base;
        /* a streaming store needs its vector's alignment; a row without it keeps STREAM 0 */
#if STREAM == 1
        const int stream = ((size_t)yr % sizeof(svt)) == 0;
        const int kept = stream && nv <= (int)(SM_SCR_BYTES / sizeof(svt));
#else
        int stream = 0, kept = 0;
#endif
        if (nv > 0) {
            /* fmax drops NaN here; a NaN still turns the whole row NaN in pass 2, where
             * exp(NaN - max) enters the sum (a row of NaN and -inf: below) */
            /* four independent maxima: one chain of compare-and-select would wait its
             * latency on every vector */
            svt mv = (svt)(-PK_INFINITY), mv1 = mv, mv2 = mv, mv3 = mv;
            int bi = lid;
            for (; bi + 3 * WG < nv; bi += 4 * WG) {
                mv = sm_vmax(mv, PK_CAT(vload, VEC)(bi, xr));
                mv1 = sm_vmax(mv1, PK_CAT(vload, VEC)(bi + WG, xr));
                mv2 = sm_vmax(mv2, PK_CAT(vload, VEC)(bi + 2 * WG, xr));
                mv3 = sm_vmax(mv3, PK_CAT(vload, VEC)(bi + 3 * WG, xr));
            }
            for (; bi < nv; bi += WG) mv = sm_vmax(mv, PK_CAT(vload, VEC)(bi, xr));
            mv = fmax(fmax(mv, mv1), fmax(mv2, mv3));
            const PK_ACC_T* ml = (const PK_ACC_T*)&mv;
            for (int l = 0; l < VEC; ++l) mx = fmax(mx, ml[l]);
            if (mx == -PK_INFINITY) {
                /* every value -inf, or NaN: the max passes dropped any NaN, and a max of
                 * -inf skips pass 2 (a row of zeros), so look for one here (rare: no
                 * cost to a row with a number in it). A NaN max makes the row NaN. */
                for (int b2 = lid; b2 < nv; b2 += WG) {
                    const svt x = PK_CAT(vload, VEC)(b2, xr);
                    if (any(isnotequal(x, x))) mx = PK_INFINITY - PK_INFINITY;
                }
            }
            j1 = nv * VEC + lid;
        }
#endif
        for (int j = j1; j < n; j += WG) {  /* a NaN, once in mx, stays */
            const PK_ACC_T x = PK_LOAD_T(X, base + j * inner);
            if (x > mx || x != x) mx = x;
        }
        lm[lid] = mx;
        PK_BARRIER();
        for (int step = WG / 2; step > 0; step >>= 1) {
            if (lid < step) {
                const PK_ACC_T other = lm[lid + step];
                if (other > lm[lid] || other != other) lm[lid] = other;
            }
            PK_BARRIER();
        }
        const PK_ACC_T rmax = lm[0];
        const int all_inf = (rmax == -PK_INFINITY);  /* no value: the row is 0 */
        PK_ACC_T sum = (PK_ACC_T)0;
        if (!all_inf) {
#if VEC > 1 && PK_HAS_VECTOR
            if (nv > 0) {
                /* the next row's lines, fetched while this row computes in cache (a
                 * contiguous next row: it is usually this item's next group) */
                const int pf = row + 1 < PK_NUM_GROUPS(0);
                /* e goes into y, to be scaled in place, unless the row streams: then into
                 * the local row (kept), or nowhere (pass 3 computes it again) */
                const int store_y = !stream;
                svt sv = (svt)(0);
                for (int b0 = lid; b0 < nv; b0 += WG * SBLK) {
                    const int bend = min(b0 + WG * SBLK, nv);
                    /* two partial sums, so consecutive vectors' adds do not wait on each
                     * other */
                    svt sp = (svt)(0), sp1 = (svt)(0);
                    int bi = b0;
                    for (; bi + WG < bend; bi += 2 * WG) {
                        if (pf) {
                            SM_PF(xr + n + bi * VEC);
                            SM_PF(xr + n + (bi + WG) * VEC);
                        }
                        const svt e0 = PK_VEXP(PK_CAT(vload, VEC)(bi, xr) - (svt)(rmax));
                        const svt e1 = PK_VEXP(PK_CAT(vload, VEC)(bi + WG, xr) - (svt)(rmax));
                        if (store_y) {
                            PK_CAT(vstore, VEC)(e0, bi, yr);
                            PK_CAT(vstore, VEC)(e1, bi + WG, yr);
                        } else if (kept) {
                            SM_KEEP(bi, e0);
                            SM_KEEP(bi + WG, e1);
                        }
                        sp += e0;
                        sp1 += e1;
                    }
                    for (; bi < bend; bi += WG) {
                        const svt e = PK_VEXP(PK_CAT(vload, VEC)(bi, xr) - (svt)(rmax));
                        if (store_y) PK_CAT(vstore, VEC)(e, bi, yr);
                        else if (kept) SM_KEEP(bi, e);
                        sp += e;
                    }
                    sv += sp + sp1;
                }
                const PK_ACC_T* sl = (const PK_ACC_T*)&sv;
                for (int l = 0; l < VEC; ++l) sum += sl[l];
            }
#endif
            for (int j0 = j1; j0 < n; j0 += WG * SBLK) {
                const int jend = min(j0 + WG * SBLK, n);
                PK_ACC_T sp = (PK_ACC_T)0;
                for (int j = j0; j < jend; j += WG) {
                    const PK_ACC_T e = exp(PK_LOAD_T(X, base + j * inner) - rmax);
                    PK_STORE_T(Y, base + j * inner, e);
                    sp += e;
                }
                sum += sp;
            }
        }
        ls[lid] = sum;
        PK_BARRIER();
        for (int step = WG / 2; step > 0; step >>= 1) {
            if (lid < step) ls[lid] += ls[lid + step];
            PK_BARRIER();
        }
        const PK_ACC_T scale = all_inf ? (PK_ACC_T)0 : (PK_ACC_T)1 / ls[0];
#if VEC > 1 && PK_HAS_VECTOR
        if (nv > 0 && all_inf) {
            for (int bi = lid; bi < nv; bi += WG) PK_CAT(vstore, VEC)((svt)(0), bi, yr);
        } else if (stream && nv > 0) {
            for (int bi = lid; bi < nv; bi += WG) {
                const svt e = kept ? SM_KEPT(bi)
                                   : PK_VEXP(PK_CAT(vload, VEC)(bi, xr) - (svt)(rmax));
                PK_STREAM_STORE(e * (svt)(scale), (PK_GLOBAL svt*)(yr + bi * VEC));
            }
        } else if (nv > 0) {
            for (int bi = lid; bi < nv; bi += WG)
                PK_CAT(vstore, VEC)(PK_CAT(vload, VEC)(bi, yr) * (svt)(scale), bi, yr);
        }
#endif
        for (int j = j1; j < n; j += WG) {
            const PK_ACC_T y = all_inf ? (PK_ACC_T)0 : PK_LOAD_T(Y, base + j * inner) * scale;
            PK_STORE_T(Y, base + j * inner, y);
        }
        return;
    }
#endif

    PK_ACC_T m = -PK_INFINITY, s = (PK_ACC_T)0;
    int j_first = lid;
#if VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T
    /* CPU schedule, contiguous rows: the same single read pass in VEC-lane vectors, UNROLL
     * vectors per block with one rescale per block, so exp runs about once per element. A
     * finite sentinel stands for "no value yet" so that all -inf lanes need no branch. */
    typedef PK_CAT(PK_ACC_T, VEC) vt;
    const int nblk = (inner == 1) ? n / (VEC * UNROLL) : 0;
    if (nblk > 0) {
        const PK_GLOBAL PK_T_T* xr = X + base;
        /* sv: the current block's partial sums (SBLK blocks of UNROLL vectors), st: the
         * earlier blocks'; both are relative to the running max mv and rescaled with it */
        vt mv = (vt)(LOWEST), sv = (vt)(0), st = (vt)(0);
        int anynan = 0, nb = 0;
        for (int bi = lid; bi < nblk; bi += WG) {
            vt xs[UNROLL];
            vt bm = mv;
            for (int u = 0; u < UNROLL; ++u) {
                xs[u] = PK_CAT(vload, VEC)(bi * UNROLL + u, xr);
                anynan |= any(isnan(xs[u]));
                bm = fmax(bm, xs[u]);
            }
            const vt f = PK_VEXP(mv - bm);
            st *= f;
            vt acc = sv * f;
            for (int u = 0; u < UNROLL; ++u) acc += PK_VEXP(xs[u] - bm);
            sv = acc;
            mv = bm;
            if (++nb == SBLK) {
                st += sv;
                sv = (vt)(0);
                nb = 0;
            }
        }
        sv += st;
        PK_ACC_T* ml = (PK_ACC_T*)&mv;
        PK_ACC_T* sl = (PK_ACC_T*)&sv;
        m = (PK_ACC_T)LOWEST;
        s = (PK_ACC_T)0;
        for (int l = 0; l < VEC; ++l) pk_merge(&m, &s, ml[l], sl[l]);
        if (anynan) m = (PK_ACC_T)NAN;
        j_first = nblk * VEC * UNROLL + lid;
    }
#endif
    for (int j = j_first; j < n; j += WG) {
        const PK_ACC_T x = PK_LOAD_T(X, base + j * inner);
        const PK_ACC_T mx = (x > m || x != x) ? x : m;
        if (mx == -PK_INFINITY) continue;
        s = s * exp(m - mx) + exp(x - mx);
        m = mx;
    }

    lm[lid] = m;
    ls[lid] = s;
    PK_BARRIER();
    for (int step = WG / 2; step > 0; step >>= 1) {
        if (lid < step) {
            PK_ACC_T mm = lm[lid], ss = ls[lid];
            pk_merge(&mm, &ss, lm[lid + step], ls[lid + step]);
            lm[lid] = mm;
            ls[lid] = ss;
        }
        PK_BARRIER();
    }
    const PK_ACC_T rm = lm[0];
    const int dead = (rm == -PK_INFINITY) || (ls[0] == (PK_ACC_T)0);
    const PK_ACC_T inv = dead ? (PK_ACC_T)0 : (PK_ACC_T)1 / ls[0];
    int jo = lid;
#if VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T
    if (nblk > 0) {
        const PK_GLOBAL PK_T_T* xr = X + base;
        PK_GLOBAL PK_T_T* yr = Y + base;
        for (int bi = lid; bi < nblk * UNROLL; bi += WG) {
            const vt y = PK_VEXP(PK_CAT(vload, VEC)(bi, xr) - (vt)(rm)) * (vt)(inv);
            PK_CAT(vstore, VEC)(y, bi, yr);
        }
        jo = nblk * VEC * UNROLL + lid;
    }
#endif
    for (int j = jo; j < n; j += WG) {
        const PK_ACC_T x = PK_LOAD_T(X, base + j * inner);
        const PK_ACC_T y = dead ? (PK_ACC_T)0 : exp(x - rm) * inv;
        PK_STORE_T(Y, base + j * inner, y);
    }
}

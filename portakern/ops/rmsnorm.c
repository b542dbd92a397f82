/* Y = X / sqrt(mean(X^2, last axis) + eps) * W. X viewed as (rows, n): row r starts at r*n;
 * W has n elements and is shared by every row.
 *
 * One work-group per row. Pass 1: each item sums the squares of its strided elements (j = lid,
 * lid + WG, ...), a tree in local memory adds the WG partial sums. Pass 2: each item writes
 * x * inv * w for the same elements (the row was just read, so it is usually still in cache).
 * The row's statistics are read from main memory once; only the output is written.
 *
 * The CPU vector path sums the plain squares first, in four independent partials, with the
 * largest |x| beside them, and repeats the row's sum with Blue's split (below) only when that
 * exceeds `big`: half the vector operations per element, and four load-add chains where one
 * waited on each load (64x4096 on a 2-core AVX2 EPYC: 230-320 -> 140-150 us on PoCL, 180-200
 * -> 90-96 us on Intel's runtime; 4096x4096 12 -> 9 ms).
 *
 * Overflow-safe in one pass, without a max pass or per-element division (Blue's two-accumulator
 * idea, as in LAPACK's nrm2): an element with |x| > big would overflow the compute type when
 * squared and summed, so it is multiplied by the exact power of two `down` first and summed
 * apart (sb). The sums are combined with exact power-of-two scalings at the end (rmsnorm.py
 * picks big/down per compute type so that neither sum can overflow for n < 2^31). Tiny
 * elements need no scaling: eps >= the smallest normal number keeps the denominator away from
 * zero, so squares that underflow cost at most n*u relative (see rmsnorm.py's error analysis).
 *
 * A non-finite element makes the whole row NaN, as the semantics do: inf lands in sb and NaN
 * in sn, so q is inf or NaN, and q - q (0 for finite q, NaN otherwise: fast-math is off, so the
 * compiler may not fold it) poisons inv.
 */
#define RBLK 256 /* terms (vectors on the vector path) per item per block partial sum */
#define PK_MASK_float int   /* the lane mask type isgreater gives for a vector of ... */
#define PK_MASK_double long

PK_KERNEL void rmsnorm(PK_GLOBAL const PK_T_T* PK_RESTRICT X, PK_GLOBAL const PK_T_T* PK_RESTRICT W,
                       PK_GLOBAL PK_T_T* PK_RESTRICT Y, int n, PK_ACC_T eps, PK_ACC_T big,
                       PK_ACC_T down)
{
    const int row = PK_GROUP_ID(0);
    const int lid = PK_LOCAL_ID(0);
    const int base = row * n; /* rows * n <= 2^31 - 1: validated from the shape */

    /* Long rows are summed in blocks: RBLK terms per item into block partials, added to the
     * running sums, so a 10^6-element row's sum errs by ~1e-7 relative, not ~1e-5. */
    PK_ACC_T sn = (PK_ACC_T)0; /* sum of x^2 over |x| <= big */
    PK_ACC_T sb = (PK_ACC_T)0; /* sum of (x * down)^2 over |x| > big */
    int j_first = lid; /* the scalar loops start here: after the vectors, or at the row's start */
#if VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T
    /* CPU schedule: VEC-lane vectors (a compiler vectorizes neither the branch below nor, on
     * PoCL, a loop across work-items with barriers after it), item lid taking vectors lid,
     * lid + WG, ...; Blue's split by a lane mask (select), so each lane sums as the scalar
     * loop would. The vectors' lanes and the scalar tail are added at the end. */
    typedef PK_CAT(PK_ACC_T, VEC) rvt;
    const PK_GLOBAL PK_T_T* xr = X + base;
    const int nv = n / VEC;
    rvt vn = (rvt)(0), vb = (rvt)(0), mx = (rvt)(0);
    /* First the plain sum of squares, in four independent partials (one loop-carried add
     * each: the core overlaps four loads and adds where one chain waited on each load), with
     * the largest |x| beside it. A NaN needs no care here (x * x carries it into the sum);
     * only an item that saw an |x| > big (an inf too) sums again with Blue's split below. */
    for (int b0 = lid; b0 < nv; b0 += WG * RBLK) {
        const int bend = min(b0 + WG * RBLK, nv);
        rvt p0 = (rvt)(0), p1 = (rvt)(0), p2 = (rvt)(0), p3 = (rvt)(0);
        int bi = b0;
        for (; bi + 3 * WG < bend; bi += 4 * WG) {
            const rvt x0 = PK_CAT(vload, VEC)(bi, xr);
            const rvt x1 = PK_CAT(vload, VEC)(bi + WG, xr);
            const rvt x2 = PK_CAT(vload, VEC)(bi + 2 * WG, xr);
            const rvt x3 = PK_CAT(vload, VEC)(bi + 3 * WG, xr);
            p0 += x0 * x0;
            p1 += x1 * x1;
            p2 += x2 * x2;
            p3 += x3 * x3;
            mx = fmax(mx, fmax(fmax(fabs(x0), fabs(x1)), fmax(fabs(x2), fabs(x3))));
        }
        for (; bi < bend; bi += WG) {
            const rvt x = PK_CAT(vload, VEC)(bi, xr);
            p0 += x * x;
            mx = fmax(mx, fabs(x));
        }
        vn += (p0 + p1) + (p2 + p3);
    }
    if (any(isgreater(mx, (rvt)(big)))) {
        vn = (rvt)(0);
        for (int b0 = lid; b0 < nv; b0 += WG * RBLK) {
            const int bend = min(b0 + WG * RBLK, nv);
            rvt pn = (rvt)(0), pb = (rvt)(0);
            for (int bi = b0; bi < bend; bi += WG) {
                const rvt x = PK_CAT(vload, VEC)(bi, xr);
                const rvt t = x * (rvt)(down);
                const PK_CAT(PK_CAT(PK_MASK_, PK_ACC_T), VEC) large =
                    isgreater(fabs(x), (rvt)(big));
                pn += select(x * x, (rvt)(0), large);
                pb += select((rvt)(0), t * t, large);
            }
            vn += pn;
            vb += pb;
        }
    }
    {
        PK_ACC_T ln_[VEC], lb_[VEC];
        PK_CAT(vstore, VEC)(vn, 0, ln_);
        PK_CAT(vstore, VEC)(vb, 0, lb_);
        for (int l = 0; l < VEC; ++l) {
            sn += ln_[l];
            sb += lb_[l];
        }
    }
    j_first = nv * VEC + lid;
#endif
    for (int j0 = j_first; j0 < n; j0 += WG * RBLK) {
        const int jend = min(j0 + WG * RBLK, n);
        PK_ACC_T pn = (PK_ACC_T)0, pb = (PK_ACC_T)0;
        for (int j = j0; j < jend; j += WG) {
            const PK_ACC_T x = PK_LOAD_T(X, base + j);
            if (fabs(x) > big) {
                const PK_ACC_T t = x * down;
                pb += t * t;
            } else {
                pn += x * x;
            }
        }
        sn += pn;
        sb += pb;
    }

    PK_LOCAL PK_ACC_T ln[WG];
    PK_LOCAL PK_ACC_T lb[WG];
    ln[lid] = sn;
    lb[lid] = sb;
    PK_BARRIER();
    for (int step = WG / 2; step > 0; step >>= 1) {
        if (lid < step) {
            ln[lid] += ln[lid + step];
            lb[lid] += lb[lid + step];
        }
        PK_BARRIER();
    }
    const PK_ACC_T tn = ln[0];
    const PK_ACC_T tb = lb[0];
    const PK_ACC_T nf = (PK_ACC_T)n;

    /* pre * inv == 1 / sqrt(mean(x^2) + eps), split so that neither factor is subnormal:
     * scaled rows use q = (mean(x^2) + eps) * down^2 and pre = down (exact). */
    PK_ACC_T pre = (PK_ACC_T)1;
    PK_ACC_T q;
    if (tb > (PK_ACC_T)0) {
        q = (tb + (tn * down) * down) / nf + (eps * down) * down;
        pre = down;
    } else {
        q = tn / nf + eps;
    }
    const PK_ACC_T inv = (PK_ACC_T)1 / sqrt(q) + (q - q);

    int jo = lid;
#if VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T
    {
        PK_GLOBAL PK_T_T* yr = Y + base;
        for (int bi = lid; bi < nv; bi += WG) {
            const rvt x = PK_CAT(vload, VEC)(bi, xr);
            PK_CAT(vstore, VEC)((x * (rvt)(pre)) * (rvt)(inv) * PK_CAT(vload, VEC)(bi, W), bi, yr);
        }
        jo = nv * VEC + lid;
    }
#endif
    for (int j = jo; j < n; j += WG) {
        const PK_ACC_T x = PK_LOAD_T(X, base + j);
        PK_STORE_T(Y, base + j, (x * pre) * inv * PK_LOAD_T(W, j));
    }
}

/* C[z] = A[z] @ B[z]; A (M,K), B (K,N), C (M,N), row-major, one dtype slot T.
 *
 * Each work-item owns a TM x TN block of C in registers; a work-group of LX x LY items owns a
 * (LY*TM) x (LX*TN) tile. Rows and columns are interleaved (row = ty + i*LY, col = tx + j*LX)
 * so neighbouring items touch neighbouring addresses: coalesced on GPUs, and vectorisable
 * across items on CPU OpenCL runtimes (PoCL packs work-items into SIMD lanes).
 * USE_LOCAL=1 (GPU schedule) stages TK-deep slices of A and B through local/shared memory;
 * USE_LOCAL=0 (CPU schedule) reads global memory directly and relies on the caches; with
 * VEC > 1 on a dialect with native vectors and plain (fp32/fp64) storage, an item's columns
 * are contiguous and held in VEC-lane vector registers. Elsewhere VEC only widens the item
 * (TN*VEC scalar columns), so every schedule is valid in every dialect.
 * Batch: group id 2 indexes up to two collapsed batch dims (z0, z1) with per-operand strides
 * (0 for broadcast dims); the host loops over any further dims through the *_off arguments.
 *
 * Long K is summed in blocks, as BLAS libraries do (they block K for the caches): every path
 * accumulates KB1 = 512 consecutive k into the register block, adds that partial sum into a
 * second-level sum, and adds the second-level sum into the total every KB2 = 16 blocks. A
 * plain running sum over K = 10^6 positive terms errs by 1.2e-4 relative (each addition
 * rounds against a sum that keeps growing); the three levels make it 6e-8 (OpenBLAS: 2.7e-7)
 * for two adds per accumulator every 512 steps (N = 1024: ~1.5% in an interleaved A/B; 64
 * cost 10%, 256 3.5%). They also keep rounding errors random for data with a large common
 * offset, where a long running sum rounds the same way at every step (matmul.py,
 * ``statistical``). Additions only: NaN and infinities propagate as in one running sum.
 */
#define NCOL (TN * VEC) /* columns of C per work-item */
#define KB1 512 /* k per first-level partial sum (a multiple of every TK) */
#define KB2 16 /* first-level blocks per second-level sum */
#define BM (LY * TM)
#define BN (LX * NCOL)

#if PACK_B
/* PACK_B=1 (CPU schedule): B is first copied into column panels of BN columns, Bp[z][panel]
 * [k][c], zero-padded past N. The product then reads each item's B columns as one contiguous
 * stream: without it, B's rows sit N floats apart, and for N a multiple of 1024 every row of a
 * panel falls into the same few cache sets, so the panel streams from L3 for every row block.
 * One item copies PACK_KB rows of one panel (few, large work-groups: cheap on a CPU). */
#define PACK_KB 64
PK_KERNEL void matmul_pack_b(PK_GLOBAL const PK_T_T* PK_RESTRICT B,
                             PK_GLOBAL PK_T_T* PK_RESTRICT Bp,
                             int N, int K, int nb1, int sb0, int sb1, int b_off)
{
    const int panel = PK_GROUP_ID(0);
    const int k0 = PK_GROUP_ID(1) * PACK_KB;
    const int z = PK_GROUP_ID(2);
    const int z0 = z / nb1;
    const int z1 = z - z0 * nb1;
    const int bo = b_off + z0 * sb0 + z1 * sb1;
    const int c0 = panel * BN;
    const int dst = (z * PK_NUM_GROUPS(0) + panel) * K * BN;
    const int kend = min(k0 + PACK_KB, K);
    for (int k = k0; k < kend; ++k)
        for (int c = 0; c < BN; ++c)
            PK_STORE_T(Bp, dst + k * BN + c,
                       (c0 + c < N) ? PK_LOAD_T(B, bo + k * N + c0 + c) : (PK_ACC_T)0);
}
#endif

/* CUDA: ask ptxas for two 256-item groups per SM (<= 128 registers: 25% occupancy); left to
 * itself it keeps the unrolled TK loop's fp64 operands in flight at 155-166 registers (12.5%).
 * `portakern resources matmul` shows the figures. */
#define MM_MIN_GROUPS (LX * LY >= 64 && LX * LY <= 512 ? 512 / (LX * LY) : 1)
PK_KERNEL PK_LAUNCH_BOUNDS(LX * LY, MM_MIN_GROUPS) void matmul(PK_GLOBAL const PK_T_T* PK_RESTRICT A,
                      PK_GLOBAL const PK_T_T* PK_RESTRICT B,
#if PACK_B
                      PK_GLOBAL const PK_T_T* PK_RESTRICT Bp,
#endif
                      PK_GLOBAL PK_T_T* PK_RESTRICT C,
                      int M, int N, int K, int nb1,
                      int sa0, int sa1, int sb0, int sb1, int sc0, int sc1,
                      int a_off, int b_off, int c_off)
{
    const int tx = PK_LOCAL_ID(0);
    const int ty = PK_LOCAL_ID(1);
    const int row0 = PK_GROUP_ID(1) * BM;
    const int col0 = PK_GROUP_ID(0) * BN;
    const int z = PK_GROUP_ID(2);
    const int z0 = z / nb1;
    const int z1 = z - z0 * nb1;
    const int ao = a_off + z0 * sa0 + z1 * sa1;
    const int bo = b_off + z0 * sb0 + z1 * sb1;
    const int co = c_off + z0 * sc0 + z1 * sc1;

    /* acc: the current KB1 block's partial sums; mid: up to KB2 blocks; tot: the rest */
    PK_ACC_T acc[TM][NCOL], mid[TM][NCOL], tot[TM][NCOL];
    #pragma unroll
    for (int i = 0; i < TM; ++i)
        #pragma unroll
        for (int j = 0; j < NCOL; ++j)
            acc[i][j] = mid[i][j] = tot[i][j] = (PK_ACC_T)0;
#define PK_FLUSH_ACC(kb) do {                                                    \
        for (int i_ = 0; i_ < TM; ++i_)                                          \
            for (int j_ = 0; j_ < NCOL; ++j_) {                                  \
                mid[i_][j_] += acc[i_][j_];                                      \
                acc[i_][j_] = (PK_ACC_T)0;                                       \
            }                                                                    \
        if ((((kb) / KB1) % KB2) == KB2 - 1)                                     \
            for (int i_ = 0; i_ < TM; ++i_)                                      \
                for (int j_ = 0; j_ < NCOL; ++j_) {                              \
                    tot[i_][j_] += mid[i_][j_];                                  \
                    mid[i_][j_] = (PK_ACC_T)0;                                   \
                }                                                                \
    } while (0)

#if USE_LOCAL
    PK_LOCAL PK_ACC_T As[TK][BM + 1];
    PK_LOCAL PK_ACC_T Bs[TK][BN];
    const int tid = ty * LX + tx;
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int idx = tid; idx < BM * TK; idx += LX * LY) {
            const int r = idx / TK, kk = idx - (idx / TK) * TK;
            const int gr = row0 + r, gk = k0 + kk;
            As[kk][r] = (gr < M && gk < K) ? PK_LOAD_T(A, ao + gr * K + gk) : (PK_ACC_T)0;
        }
        for (int idx = tid; idx < BN * TK; idx += LX * LY) {
            const int kk = idx / BN, c = idx - (idx / BN) * BN;
            const int gk = k0 + kk, gc = col0 + c;
            Bs[kk][c] = (gk < K && gc < N) ? PK_LOAD_T(B, bo + gk * N + gc) : (PK_ACC_T)0;
        }
        PK_BARRIER();
        for (int kk = 0; kk < TK; ++kk) {
            PK_ACC_T b[NCOL];
            #pragma unroll
            for (int j = 0; j < NCOL; ++j) b[j] = Bs[kk][tx + j * LX];
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                const PK_ACC_T a = As[kk][ty + i * LY];
                #pragma unroll
                for (int j = 0; j < NCOL; ++j) acc[i][j] += a * b[j];
            }
        }
        PK_BARRIER();
        if ((k0 + TK) % KB1 == 0) PK_FLUSH_ACC(k0);
    }
#elif VEC > 1 && PK_HAS_VECTOR && PK_PLAIN_T
    /* CPU schedule with native vectors: an item owns TM rows x NCOL contiguous columns held
     * in TN vector registers of VEC lanes: per k, TN vector loads of B, TM broadcasts of A,
     * TM*TN vector FMAs (a register-blocked outer product, as BLAS micro-kernels do). */
    typedef PK_CAT(PK_ACC_T, VEC) vacc_t;
    const int c0 = col0 + tx * NCOL;
    int arow[TM];
    for (int i = 0; i < TM; ++i) arow[i] = ao + min(row0 + ty + i * LY, M - 1) * K;
#if PACK_B
    /* Beside packed B, A's rows as pointers indexed by k alone: each a base register, each
     * load one addressing mode. With A[arow[i] + k] PoCL recomputes every index in 32 bits
     * and sign-extends it, a dozen integer instructions per k beside the 12 FMAs (AVX2,
     * 2-core EPYC, PoCL / Intel: N=512 1.6 / 1.05x, N=1024 1.59 / 1.06x, N=2048 1.5 / 1.12x
     * faster). Beside B read in place the index form is the faster one (Intel: 3-13%). */
    const PK_GLOBAL PK_T_T* ap[TM];
    for (int i = 0; i < TM; ++i) ap[i] = A + arow[i];
#define MM_A(i, k) ap[i][k]
#else
#define MM_A(i, k) A[arow[i] + (k)]
#endif
#if PACK_B
    /* packed panels are zero-padded: every item takes the vector path; stores are masked */
    {
        const PK_GLOBAL PK_T_T* bp = Bp + (z * PK_NUM_GROUPS(0) + PK_GROUP_ID(0)) * K * BN
                                     + tx * NCOL;
        const int ldb = BN;
#else
    if (c0 + NCOL <= N) {
        const PK_GLOBAL PK_T_T* bp = B + bo + c0;
        const int ldb = N;
#endif
        /* vacc (registers): a KB1 block; vmid, vtot: the second and third level */
        vacc_t vacc[TM][TN], vmid[TM][TN], vtot[TM][TN];
        #pragma unroll
        for (int i = 0; i < TM; ++i)
            #pragma unroll
            for (int j = 0; j < TN; ++j) vmid[i][j] = vtot[i][j] = (vacc_t)(0);
        for (int kb = 0; kb < K; kb += KB1) {
            const int kend = min(kb + KB1, K);
            #pragma unroll
            for (int i = 0; i < TM; ++i)
                #pragma unroll
                for (int j = 0; j < TN; ++j) vacc[i][j] = (vacc_t)(0);
            for (int k = kb; k < kend; ++k) {
                vacc_t b[TN];
                #pragma unroll
                for (int j = 0; j < TN; ++j) b[j] = PK_CAT(vload, VEC)(j, bp + k * ldb);
                #pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const PK_ACC_T a = MM_A(i, k);
                    #pragma unroll
                    for (int j = 0; j < TN; ++j) vacc[i][j] = fma((vacc_t)(a), b[j], vacc[i][j]);
                }
            }
            for (int i = 0; i < TM; ++i)
                for (int j = 0; j < TN; ++j) vmid[i][j] += vacc[i][j];
            if (((kb / KB1) % KB2) == KB2 - 1 || kend == K)
                for (int i = 0; i < TM; ++i)
                    for (int j = 0; j < TN; ++j) {
                        vtot[i][j] += vmid[i][j];
                        vmid[i][j] = (vacc_t)(0);
                    }
        }
        if (c0 + NCOL <= N) {
            for (int i = 0; i < TM; ++i) {
                const int r = row0 + ty + i * LY;
                if (r < M)
                    for (int j = 0; j < TN; ++j) PK_CAT(vstore, VEC)(vtot[i][j], 0, C + co + r * N + c0 + j * VEC);
            }
        } else {
            for (int i = 0; i < TM; ++i) {
                const int r = row0 + ty + i * LY;
                if (r >= M) continue;
                for (int j = 0; j < TN; ++j) {
                    const PK_ACC_T* lane = (const PK_ACC_T*)&vtot[i][j];
                    for (int l = 0; l < VEC; ++l)
                        if (c0 + j * VEC + l < N) C[co + r * N + c0 + j * VEC + l] = lane[l];
                }
            }
        }
        return;
    }
#undef MM_A
    /* right edge (fewer than NCOL columns left): scalar, same ownership */
    for (int kb = 0; kb < K; kb += KB1) {
        const int kend = min(kb + KB1, K);
        for (int k = kb; k < kend; ++k) {
            for (int i = 0; i < TM; ++i) {
                const PK_ACC_T a = A[arow[i] + k];
                for (int j = 0; j < NCOL; ++j)
                    if (c0 + j < N) acc[i][j] += a * B[bo + k * N + c0 + j];
            }
        }
        PK_FLUSH_ACC(kb);
    }
    for (int i = 0; i < TM; ++i) {
        const int r = row0 + ty + i * LY;
        if (r >= M) continue;
        for (int j = 0; j < NCOL; ++j)
            if (c0 + j < N) C[co + r * N + c0 + j] = tot[i][j] + mid[i][j];
    }
    return;
#else
    /* Clamp out-of-range rows/columns to a valid address and drop them at the store:
     * no branch in the inner loop. */
    int arow[TM];
    int bcol[NCOL];
    for (int i = 0; i < TM; ++i) arow[i] = ao + min(row0 + ty + i * LY, M - 1) * K;
#if PACK_B
    const PK_GLOBAL PK_T_T* bsrc = Bp;
    const int ldb = BN;
    const int pbase = (z * PK_NUM_GROUPS(0) + PK_GROUP_ID(0)) * K * BN;
    for (int j = 0; j < NCOL; ++j) bcol[j] = pbase + tx + j * LX;  /* zero-padded panel */
#else
    const PK_GLOBAL PK_T_T* bsrc = B;
    const int ldb = N;
    for (int j = 0; j < NCOL; ++j) bcol[j] = bo + min(col0 + tx + j * LX, N - 1);
#endif
    for (int kb = 0; kb < K; kb += KB1) {
        const int kend = min(kb + KB1, K);
        for (int k = kb; k < kend; ++k) {
            PK_ACC_T b[NCOL];
            #pragma unroll
            for (int j = 0; j < NCOL; ++j) b[j] = PK_LOAD_T(bsrc, bcol[j] + k * ldb);
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                const PK_ACC_T a = PK_LOAD_T(A, arow[i] + k);
                #pragma unroll
                for (int j = 0; j < NCOL; ++j) acc[i][j] += a * b[j];
            }
        }
        PK_FLUSH_ACC(kb);
    }
#endif

    for (int i = 0; i < TM; ++i) {
        const int r = row0 + ty + i * LY;
        if (r >= M) continue;
        for (int j = 0; j < NCOL; ++j) {
            const int c = col0 + tx + j * LX;
            if (c < N) PK_STORE_T(C, co + r * N + c, tot[i][j] + (mid[i][j] + acc[i][j]));
        }
    }
}

#if MMA
/* The fragment schedule (MMA=1, fp16/bf16: matmul.py): matrix units through the fragment API
 * (mma.c, docs/fragments.md), and nothing here knows a lane layout. A work-group of MITEMS
 * items (a multiple of every wave) owns an MBM x MBN block of C, MBM/16 x MBN/16 tiles; its
 * waves split the tiles evenly, each wave an MM_WM x MM_WN arrangement of them, so a wave
 * loads MM_WM A and MM_WN B fragments per 16-deep k step for MM_WM * MM_WN tile products.
 * TK-deep slices of A and B are staged in local memory as their 16-bit patterns, zero-padded
 * past M, N and K (padding adds exact zeros). Long K is summed as on every other path: the
 * tile products accumulate one KB1 block in the C fragments (k in order: 16 per product),
 * block sums are added outside pk_mma into a second-level sum, and every KB2 blocks into the
 * total, so the emulation computes the same tree as the SIMT paths. */
#define MM_TM16 (MBM / 16)
#define MM_TN16 (MBN / 16)
#define MM_WAVES (MITEMS / PK_MMA_WAVE)
#define MM_TPW (MM_TM16 * MM_TN16 / MM_WAVES) /* tiles per wave */
#define MM_WN (MM_TPW < MM_TN16 ? MM_TPW : MM_TN16)
#define MM_WM (MM_TPW / MM_WN)
#define MM_WCOLS (MM_TN16 / MM_WN) /* waves side by side */
#if MITEMS % PK_MMA_WAVE != 0 || (MM_TM16 * MM_TN16) % MM_WAVES != 0 || MM_TN16 % MM_WN != 0 \
    || MM_TPW % MM_WN != 0 || MM_TM16 % MM_WM != 0 || TK % 16 != 0
#error "matmul MMA schedule: MBM, MBN, MITEMS and TK do not split into whole waves and tiles"
#endif
PK_KERNEL PK_MMA_KERNEL_ATTR PK_LAUNCH_BOUNDS(MITEMS, MITEMS <= 512 ? 512 / MITEMS : 1)
void matmul_mma(PK_GLOBAL const PK_T_T* PK_RESTRICT A, PK_GLOBAL const PK_T_T* PK_RESTRICT B,
                PK_GLOBAL PK_T_T* PK_RESTRICT C, int M, int N, int K, int nb1,
                int sa0, int sa1, int sb0, int sb1, int sc0, int sc1,
                int a_off, int b_off, int c_off)
{
    PK_LOCAL unsigned short As[MBM * TK]; /* As[r * TK + k] */
    PK_LOCAL unsigned short Bs[TK * MBN]; /* Bs[k * MBN + n] */
    PK_MMA_SCRATCH(scratch, MM_WAVES);
    const int tid = PK_LOCAL_ID(0);
    const int lane = PK_MMA_LANE(tid);
    const int wave = PK_MMA_WAVE_ID(tid);
    const int tm0 = (wave / MM_WCOLS) * MM_WM; /* the wave's first tile row and column */
    const int tn0 = (wave - (wave / MM_WCOLS) * MM_WCOLS) * MM_WN;
    PK_LOCAL_PTR unsigned short* ws = scratch + wave * PK_MMA_SCRATCH_WORDS;
    const int row0 = PK_GROUP_ID(1) * MBM;
    const int col0 = PK_GROUP_ID(0) * MBN;
    const int z = PK_GROUP_ID(2);
    const int z0 = z / nb1;
    const int z1 = z - z0 * nb1;
    const int ao = a_off + z0 * sa0 + z1 * sa1;
    const int bo = b_off + z0 * sb0 + z1 * sb1;
    const int co = c_off + z0 * sc0 + z1 * sc1;

    pk_frag_c acc[MM_WM][MM_WN], mid[MM_WM][MM_WN], tot[MM_WM][MM_WN];
    for (int i = 0; i < MM_WM; ++i)
        for (int j = 0; j < MM_WN; ++j) {
            pk_mma_fill_c(&acc[i][j], 0.0f);
            pk_mma_fill_c(&mid[i][j], 0.0f);
            pk_mma_fill_c(&tot[i][j], 0.0f);
        }
    for (int k0 = 0; k0 < K; k0 += TK) {
        for (int idx = tid; idx < MBM * TK; idx += MITEMS) {
            const int r = idx / TK, kk = idx - (idx / TK) * TK;
            const int gr = row0 + r, gk = k0 + kk;
            As[idx] = (gr < M && gk < K) ? PK_BITS_T(A, ao + gr * K + gk) : (unsigned short)0;
        }
        for (int idx = tid; idx < TK * MBN; idx += MITEMS) {
            const int kk = idx / MBN, c = idx - (idx / MBN) * MBN;
            const int gk = k0 + kk, gc = col0 + c;
            Bs[idx] = (gk < K && gc < N) ? PK_BITS_T(B, bo + gk * N + gc) : (unsigned short)0;
        }
        PK_BARRIER();
        for (int kk = 0; kk < TK; kk += 16) {
            pk_frag_a fa[MM_WM];
            pk_frag_b fb[MM_WN];
            for (int i = 0; i < MM_WM; ++i)
                pk_mma_load_a(&fa[i], As + (tm0 + i) * 16 * TK + kk, TK, 1, lane);
            for (int j = 0; j < MM_WN; ++j)
                pk_mma_load_b(&fb[j], Bs + kk * MBN + (tn0 + j) * 16, MBN, 1, lane);
            for (int i = 0; i < MM_WM; ++i)
                for (int j = 0; j < MM_WN; ++j)
                    PK_MMA_T(&acc[i][j], &fa[i], &fb[j], ws, lane);
        }
        PK_BARRIER();
        if ((k0 + TK) % KB1 == 0) { /* a KB1 block is complete: add it outside pk_mma */
            for (int i = 0; i < MM_WM; ++i)
                for (int j = 0; j < MM_WN; ++j)
                    for (int e = 0; e < PK_MMA_C_ELEMS; ++e) {
                        mid[i][j].x[e] += acc[i][j].x[e];
                        acc[i][j].x[e] = 0.0f;
                    }
            if (((k0 / KB1) % KB2) == KB2 - 1)
                for (int i = 0; i < MM_WM; ++i)
                    for (int j = 0; j < MM_WN; ++j)
                        for (int e = 0; e < PK_MMA_C_ELEMS; ++e) {
                            tot[i][j].x[e] += mid[i][j].x[e];
                            mid[i][j].x[e] = 0.0f;
                        }
        }
    }
    for (int i = 0; i < MM_WM; ++i)
        for (int j = 0; j < MM_WN; ++j)
            for (int e = 0; e < PK_MMA_C_ELEMS; ++e) {
                const int r = row0 + (tm0 + i) * 16 + PK_MMA_C_ROW(lane, e);
                const int c = col0 + (tn0 + j) * 16 + PK_MMA_C_COL(lane, e);
                if (r < M && c < N)
                    PK_STORE_T(C, co + r * N + c,
                               tot[i][j].x[e] + (mid[i][j].x[e] + acc[i][j].x[e]));
            }
}
#endif

"""The suite must be able to fail: deliberately broken kernels are caught by the same checks.

Each mutant is a one-line edit of a shipped kernel — an off-by-one bound, a missing barrier,
low-precision accumulation, a causal off-by-one — registered as its own op and run on every
C-kernel target through the same case generators and tolerance rules as test_ops.py. A
mutant that survives means the suite is too weak to trust.
"""

from __future__ import annotations

import numpy as np
import pytest

import portakern as pk
from portakern.core import codegen
from portakern.core.sampling import Case, NumpyChooser
from portakern.ops import get_op
from portakern.runtime import selection
from portakern.tools.cases import CASES, compare

# the scalar direct matmul path (no vectors, no local tiles): where the rounding mutants sit
SCALAR_MATMUL = {"USE_LOCAL": 0, "VEC": 1, "TM": 4, "TN": 4, "LX": 4, "LY": 4}
_B_LOAD = "PK_LOAD_T(bsrc, bcol[j] + k * ldb)"
_A_LOAD = "PK_LOAD_T(A, arow[i] + k)"
_MM_LOADS = (f"for (int j = 0; j < NCOL; ++j) b[j] = {_B_LOAD};\n"
             "            #pragma unroll\n            for (int i = 0; i < TM; ++i) {\n"
             f"                const PK_ACC_T a = {_A_LOAD};")


def _r10(x: str) -> str:
    """C: x rounded to 10 explicit mantissa bits, to nearest even (TF32's, fp16's)."""
    return f"PK_AS_FLOAT((PK_AS_UINT({x}) + 0xFFFu + ((PK_AS_UINT({x}) >> 13) & 1u)) & 0xFFFFE000u)"


def _bf16(x: str) -> str:
    return f"pk_bf16_to_float(pk_float_to_bf16({x}))"


def _fp16(x: str) -> str:
    """fp16's significand and range (overflow to inf); subnormals not modelled."""
    return f"(fabs({_r10(x)}) > 65504.0f ? ({x}) * PK_INFINITY : {_r10(x)})"


def _rounded_loads(r) -> str:  # noqa: ANN001
    return _MM_LOADS.replace(f"= {_B_LOAD}", f"= {r(_B_LOAD)}").replace(f"= {_A_LOAD}",
                                                                         f"= {r(_A_LOAD)}")


# attention_combine's two loops over the key ranges (the sum of l, the accumulators)
_COMBINE_L = ("for (int s = 0; s < nsplit; ++s) {\n        const PK_ACC_T ms = part[s * (DV_ + 2)];"
              "\n        const PK_ACC_T w")
_COMBINE_ACC = "for (int s = 0; s < nsplit; ++s) {\n            const PK_ACC_T ms"

MUTANTS = {
    "matmul: K loop stops one short": (
        "matmul", "        const int kend = min(kb + KB1, K);\n"
        "        for (int k = kb; k < kend; ++k) {\n            PK_ACC_T b[NCOL];",
        "        const int kend = min(kb + KB1, K - 1);\n"
        "        for (int k = kb; k < kend; ++k) {\n            PK_ACC_T b[NCOL];",
        SCALAR_MATMUL, "float32"),
    "matmul: local tile drops the last K element": (
        "matmul", "As[kk][r] = (gr < M && gk < K)", "As[kk][r] = (gr < M && gk + 1 < K)",
        {"USE_LOCAL": 1, "LX": 8, "LY": 8, "TM": 2, "TN": 2, "TK": 8}, "float32"),
    "matmul: bf16 accumulation": (
        "matmul", "for (int j = 0; j < NCOL; ++j) acc[i][j] += a * b[j];\n"
        "            }\n        }\n        PK_FLUSH_ACC(kb);\n    }\n#endif",
        "for (int j = 0; j < NCOL; ++j) acc[i][j] = pk_bf16_to_float(pk_float_to_bf16("
        "acc[i][j] + a * b[j]));\n"
        "            }\n        }\n        PK_FLUSH_ACC(kb);\n    }\n#endif",
        {"USE_LOCAL": 0}, "bfloat16"),
    "matmul: vector path skips the last k": (
        "matmul", "const int kend = min(kb + KB1, K);\n            #pragma unroll",
        "const int kend = min(kb + KB1, K - 1);\n            #pragma unroll",
        {"VEC": 16, "USE_LOCAL": 0},
        "float32"),
    # the packed path's A rows as pointers (matmul.c MM_A): each pointer at the next row the
    # item owns (in bounds: rows are clamped)
    "matmul: packed path pairs each C row with the next A row": (
        "matmul", "for (int i = 0; i < TM; ++i) ap[i] = A + arow[i];",
        "for (int i = 0; i < TM; ++i) ap[i] = A + arow[(i + 1) % TM];",
        {"VEC": 8, "TM": 6, "TN": 2, "LX": 1, "LY": 4, "PACK_B": 1, "USE_LOCAL": 0}, "float32"),
    # issue 14: results a worst-case bound of 2 K u |A||B| lets through at K = 4096 and 16384;
    # the statistical check (portakern.verify) catches them, through the same compare()
    "matmul: inputs rounded to TF32 (10-bit mantissa)": (
        "matmul", _MM_LOADS, _rounded_loads(_r10), SCALAR_MATMUL, "float32"),
    "matmul: inputs rounded to bf16": (
        "matmul", _MM_LOADS, _rounded_loads(_bf16), SCALAR_MATMUL, "float32"),
    "matmul: one K term dropped (the middle one)": (
        "matmul", "        for (int k = kb; k < kend; ++k) {\n            PK_ACC_T b[NCOL];",
        "        for (int k = kb; k < kend; ++k) {\n            if (k == K / 2) continue;\n"
        "            PK_ACC_T b[NCOL];", SCALAR_MATMUL, "float32"),
    "matmul: fp16 accumulation (11-bit significand, fp16's range)": (
        "matmul", "for (int j = 0; j < NCOL; ++j) acc[i][j] += a * b[j];\n"
        "            }\n        }\n        PK_FLUSH_ACC(kb);",
        "for (int j = 0; j < NCOL; ++j) acc[i][j] = " + _fp16("acc[i][j] + a * b[j]")
        + ";\n            }\n        }\n        PK_FLUSH_ACC(kb);", SCALAR_MATMUL, "float32"),
    # the one-read online path (STORE_EXP=0: GPU schedule, fp16/bf16 storage)
    "softmax: missing barrier in the reduction": (
        "softmax", "            ls[lid] = ss;\n        }\n        PK_BARRIER();",
        "            ls[lid] = ss;\n        }", {"WG": 64, "STORE_EXP": 0}, "float32"),
    "softmax: max not subtracted in the output": (
        "softmax", "exp(x - rm) * inv", "exp(x) * inv", {"STORE_EXP": 0}, "float32"),
    "softmax: vector exp without the low part of ln2": (
        "softmax", "    r = fma(k, (pk_fv)(2.6524305e-5f), r);\n", "",
        {"VEC": 16, "WG": 1, "STORE_EXP": 0}, "float32"),
    "softmax: vector exp rounds k with 2^23 instead of 1.5 * 2^23": (
        "softmax", "(pk_fv)(12582912.0f));\n    const pk_fv k = shifted - (pk_fv)(12582912.0f);",
        "(pk_fv)(8388608.0f));\n    const pk_fv k = shifted - (pk_fv)(8388608.0f);",
        {"VEC": 16, "WG": 1, "STORE_EXP": 1}, "float32"),
    # the CPU schedule's exp-once path (STORE_EXP 1, VEC 16): its max pass over the scalar
    # tail starts one element late; only a row whose max sits there (the generator's
    # "spike" values) overflows exp and shows it
    "softmax: the max pass skips the first element past the vectors": (
        "softmax", "for (int j = j1; j < n; j += WG) {  /* a NaN, once in mx, stays */",
        "for (int j = j1 + WG; j < n; j += WG) {  /* a NaN, once in mx, stays */",
        {"STORE_EXP": 1, "VEC": 16, "WG": 1}, "float32"),
    "softmax: vector path skips the block rescale": (
        "softmax", "vt acc = sv * f;", "vt acc = sv;",
        {"VEC": 16, "WG": 1, "STORE_EXP": 0}, "float32"),
    # the exp-once path (STORE_EXP=1: CPU schedule, fp32/fp64 storage)
    "softmax exp-once: missing barrier in the sum tree": (
        "softmax",
        "            if (lid < step) ls[lid] += ls[lid + step];\n            PK_BARRIER();",
        "            if (lid < step) ls[lid] += ls[lid + step];",
        {"WG": 64, "VEC": 1, "STORE_EXP": 1}, "float32"),
    "softmax exp-once: scale pass skipped (vector path)": (
        "softmax", "PK_CAT(vload, VEC)(bi, yr) * (svt)(scale)", "PK_CAT(vload, VEC)(bi, yr)",
        {"VEC": 16, "WG": 1, "STORE_EXP": 1}, "float32"),
    "softmax exp-once: vector exp without the low part of ln2": (
        "softmax", "    r = fma(k, (pk_fv)(2.6524305e-5f), r);\n", "",
        {"VEC": 16, "WG": 1, "STORE_EXP": 1}, "float32"),
    "softmax exp-once: vector exp's table swaps two eighths of an octave": (
        "softmax", "0x3f7837f0, 0x3f75fed7", "0x3f75fed7, 0x3f7837f0",
        {"VEC": 16, "WG": 1, "STORE_EXP": 1}, "float32"),
    # the streamed output (STREAM=1: exp again in the scale pass, non-temporal stores)
    "softmax streamed: the streamed store skips the scale": (
        "softmax", "PK_STREAM_STORE(e * (svt)(scale),", "PK_STREAM_STORE(e,",
        {"VEC": 16, "WG": 1, "STORE_EXP": 1, "STREAM": 1}, "float32"),
    "softmax streamed: the kept row holds the wrong vector": (
        "softmax", "SM_KEEP(bi + WG, e1);", "SM_KEEP(bi + WG, e0);",
        {"VEC": 16, "WG": 1, "STORE_EXP": 1, "STREAM": 1}, "float32"),
    "attention: causal off by one": (
        "attention", "(!causal || kj <= qi)", "(!causal || kj < qi)", {}, "float32"),
    "attention: no rescale of the accumulator (scalar path)": (
        "attention", "for (int d = 0; d < DV; ++d) acc[t][d] *= corr;", "", {"BK": 4}, "float32"),
    "attention: no rescale of the accumulator (vector path)": (
        "attention", "for (int c = 0; c < NAV; ++c) a[t][c] *= (vt)(corr);",
        "for (int c = 0; c < NAV; ++c) a[t][c] *= (vt)(1);", {"BK": 16}, "float32"),
    "attention: transposed K tile off by one key": (
        "attention", "Kt[d][j] = (k0 + j < Sk)", "Kt[d][j] = (k0 + j + 1 < Sk)",
        {"BK": 16, "PACK_KV": 0, "BQ": 8}, "float32"),
    "attention: staged path missing the barrier after the K/V tile loads": (
        "attention", "#if !AT_PACKED\n        PK_BARRIER();\n#endif\n\n#if AT_VEC",
        "#if AT_VEC", {"BK": 16, "PACK_KV": 0, "BQ": 8}, "float32"),
    "attention: vector exp without the low part of ln2": (
        "attention", "    r = fma(k, (pk_fv)(2.6524305e-5f), r);\n", "",
        {"BK": 16, "VEC": 16}, "float32"),
    # (a dropped cubic term errs by at most 1.4e-5 relative, unbiased: attention's sums
    # average it away, tests/ops/test_vexp.py catches it on the exp itself)
    "attention: vector exp drops the polynomial's quadratic term": (
        "attention", "    pk_fv p = fma((pk_fv)(0.166668579f), r, (pk_fv)(0.500064492f));",
        "    pk_fv p = (pk_fv)(0.166668579f) * r;",
        {"BK": 16, "VEC": 16}, "float32"),
    "attention: packed path reads every tile's V rows from the first tile": (
        "attention", "#define AT_VROW(j) (vph + (k0 + (j)) * DVP)",
        "#define AT_VROW(j) (vph + (j) * DVP)",
        {"BK": 16, "VEC": 16, "PACK_KV": 1, "BQ": 1}, "float32"),
    "attention: packed path reads the tile's keys one dimension late": (
        "attention", "#define AT_KROW(d) (kth + (k0 / BK * DQ_ + (d)) * BK)",
        "#define AT_KROW(d) (kth + (k0 / BK * DQ_ + ((d) + 1) % DQ_) * BK)",
        {"BK": 16, "VEC": 16, "PACK_KV": 1, "BQ": 1}, "float32"),
    "attention: P.V also runs rows with nothing to attend in the tile": (
        "attention",
        "pv[t] = (vt)(on[t] ? pt[t][j] : (PK_ACC_T)0);", "pv[t] = (vt)(pt[t][j]);",
        {"BK": 16, "VEC": 16}, "float32"),
    "attention: the denominators' lane sum drops a lane": (
        "attention", "e[i] += e[i + w];", "e[i] += (w == 1) ? (PK_ACC_T)0 : e[i + w];",
        {"BK": 16, "VEC": 16}, "float32"),
    "attention: the tile's causal test uses the block's last query, not its first": (
        "attention", "causal && k0 + BK - 1 > q0 + t0;",
        "causal && k0 + BK - 1 > q0 + t0 + TQ - 1;", {"BK": 16, "VEC": 16}, "float32"),
    "attention: the causal diagonal's select keeps each query's next key": (
        "attention", "iota > (vt)((PK_ACC_T)(q0 + t0 + t - k0 - c * VEC))",
        "iota > (vt)((PK_ACC_T)(q0 + t0 + t + 1 - k0 - c * VEC))", {"BK": 16, "VEC": 16},
        "float32"),
    "attention: a moved running max keeps the old scale": (
        "attention", "(mn == m[t0 + t]) ? (PK_ACC_T)1", "(mn != m[t0 + t]) ? (PK_ACC_T)1",
        {"BK": 16, "VEC": 16}, "float32"),
    "attention: every register block of an item uses the first block's state": (
        "attention", "const int t0 = r * TQ;", "const int t0 = 0;",
        {"BK": 16, "VEC": 16, "TQ": 2, "RQ": 4}, "float32"),
    "attention: packed K tiles laid out one tile apart too few": (
        "attention", "#define AT_KROW(d) (kth + (k0 / BK * DQ_ + (d)) * BK)",
        "#define AT_KROW(d) (kth + (k0 / BK * (DQ_ - 1) + (d)) * BK)",
        {"BK": 16, "VEC": 16, "PACK_KV": 1, "BQ": 1}, "float32"),
    # non-finite values and range (issue 14, issue 19 item 7): caught by the generator's NaN,
    # inf, scale and range families through the same comparison (NaN-ness is exact)
    "attention: a row is empty whenever !(l > 0) (the old Pallas test: NaN rows become 0)": (
        "attention", "PK_STORE_T(O, (bh * Sq + qi) * DV + d, ar[d] * inv);",
        "PK_STORE_T(O, (bh * Sq + qi) * DV + d,\n"
        "                                     !(l[t] > (PK_ACC_T)0) ? (PK_ACC_T)0 : ar[d] * inv);",
        {}, "float32"),
    "attention: the scale multiplies the dot after it, not q before it": (
        "attention",
        ("int nqb, PK_ACC_T scale,",
         "    const int split = gs - g * nsplit;\n    const int bh = g / nqb;",
         "            /* The accumulators are copied into a tile-local array"),
        ("int nqb, PK_ACC_T scale_after,",
         "    const PK_ACC_T scale = (PK_ACC_T)1; /* q unscaled */\n"
         "    const int split = gs - g * nsplit;\n    const int bh = g / nqb;",
         "            for (int t = 0; t < TQ; ++t)\n"
         "                for (int c = 0; c < NSV; ++c) sv[t][c] *= (vt)(scale_after);\n"
         "            /* The accumulators are copied into a tile-local array"),
        {"BK": 16, "VEC": 16}, "float32"),
    "attention: a masked key's NaN/inf V row enters P.V unzeroed (packed path)": (
        "attention", "            bad = 1;\n            x = (PK_ACC_T)0;\n",
        "            bad = 1;\n",
        {"BK": 16, "VEC": 16, "PACK_KV": 1, "BQ": 1}, "float32"),
    # issue 28: the forward's log-sum-exp and the fused backward
    "attention: lse from the next row": (
        "attention", "LSE[bh * Sq + qi] = dead", "LSE[bh * Sq + min(qi + 1, Sq - 1)] = dead",
        {}, "float32"),
    # issue 29: the score modifiers and the window (attention_mods.c, both inner paths)
    "attention: window off by one on the left": (
        "attention", "return kpos - qpos >= -left &&", "return kpos - qpos > -left &&", {},
        "float32"),
    "attention: softcap applied after masking (masked keys score -c, not -inf)": (
        "attention",
        ("const PK_ACC_T s = !ok ? -PK_INFINITY : AT_VBAD(jb + j)",
         "const PK_ACC_T sj = ok ? AT_SCORE(pt[t][j], brow, qi, kj) : -PK_INFINITY;",
         "const PK_ACC_T sj = !ok ? -PK_INFINITY : AT_VBAD(j)"),
        ("const PK_ACC_T s = !ok ? (AT_HAS(AT_BIT_CAP) ? -cap : -PK_INFINITY) : AT_VBAD(jb + j)",
         "const PK_ACC_T sj = ok ? AT_SCORE(pt[t][j], brow, qi, kj)"
         " : (AT_HAS(AT_BIT_CAP) ? -cap : -PK_INFINITY);",
         "const PK_ACC_T sj = !ok ? (AT_HAS(AT_BIT_CAP) ? -cap : -PK_INFINITY) : AT_VBAD(j)"), {},
        "float32"),
    "attention: ALiBi with the wrong sign": (
        "attention", "s = s - slope * (PK_ACC_T)", "s = s + slope * (PK_ACC_T)", {}, "float32"),
    "attention: bias ignores the query row": (
        "attention",
        ("const int brow = b * bs0 + h * bs1 + min(qi, Sq - 1) * bs2;",
         "const int brow = b * bs0 + h * bs1 + min(qi, Sq - 1) * bs2;"),
        ("const int brow = b * bs0 + h * bs1;", "const int brow = b * bs0 + h * bs1;"), {},
        "float32"),
    "attention: split-K's combine drops the last key range": (
        "attention", (_COMBINE_L, _COMBINE_ACC),
        (_COMBINE_L.replace("s < nsplit", "s < nsplit - 1"),
         _COMBINE_ACC.replace("s < nsplit", "s < nsplit - 1")), {"SPLIT": 4, "BK": 16},
        "float32"),
    "attention: split-K ranges overlap by a tile": (
        "attention", "kend = min(kend, split * chunk + chunk);",
        "kend = min(kend, split * chunk + chunk + BK);", {"SPLIT": 4, "BK": 16}, "float32"),
    # each site in the scalar path (GPU schedule) and in the vector path (CPU schedule)
    "attention_backward: delta missing": (
        "attention_backward",
        ("const PK_ACC_T ds = p * (dp - DELTA[qrow]);",
         "AB_VSTORE(p * (dpv[t][c] - dl), c, &dst[t][0]);",
         "AB_VSTORE(p * (dpv[t][c] - (ab_vt)(dl[t])), c, &dst[t][0]);"),
        ("const PK_ACC_T ds = p * dp;", "AB_VSTORE(p * dpv[t][c], c, &dst[t][0]);",
         "AB_VSTORE(p * dpv[t][c], c, &dst[t][0]);"), {}, "float32"),
    "attention_backward: the scale missing in dQ": (
        "attention_backward",
        ("PK_STORE_T(DQO, r * DQ + d, dq[d] * scale);",
         "AB_VSTORE(dq[t][u] * (ab_vt)(scale), u, DQO + r * DQ);"),
        ("PK_STORE_T(DQO, r * DQ + d, dq[d]);", "AB_VSTORE(dq[t][u], u, DQO + r * DQ);"), {},
        "float32"),
    "attention_backward: the GQA sum drops a head": (
        "attention_backward",
        ("for (int hh = 0; hh < group; ++hh) {", "for (int hh = 0; hh < group; ++hh) {"),
        ("for (int hh = 0; hh < (group > 1 ? group - 1 : 1); ++hh) {",
         "for (int hh = 0; hh < (group > 1 ? group - 1 : 1); ++hh) {"), {}, "float32"),
    # the loop bounds and ab_keep both apply causal: a one-site edit of either bound that
    # widens it is masked by the other, so these drop the diagonal, and the last one shifts
    # causal by one key everywhere in the backward (all three sites; the vector path's lane
    # tests and bounds too)
    "attention_backward: causal off by one (dQ drops the diagonal)": (
        "attention_backward",
        ("const int jend = causal ? min(i + 1, Sk) : Sk;",
         "int ok = j < Sk && (!causal || j <= i);"),
        ("const int jend = causal ? min(i, Sk) : Sk;",
         "int ok = j < Sk && (!causal || j < i);"), {}, "float32"),
    "attention_backward: causal off by one (dK/dV drops the diagonal)": (
        "attention_backward",
        ("for (int i = causal ? j : 0; i < Sq; ++i) {",
         "int ok = i < Sq && (!causal || i >= j0 + t);"),
        ("for (int i = causal ? j + 1 : 0; i < Sq; ++i) {",
         "int ok = i < Sq && (!causal || i > j0 + t);"), {}, "float32"),
    "attention_backward: causal off by one key everywhere": (
        "attention_backward",
        ("    if (causal && j > i) return 0;", "const int jend = causal ? min(i + 1, Sk) : Sk;",
         "for (int i = causal ? j : 0; i < Sq; ++i) {",
         "int ok = i < Sq && (!causal || i >= j0 + t);",
         "const int ibeg = causal ? (j0 / BLK) * BLK : 0;",
         "int ok = j < Sk && (!causal || j <= i);",
         "const int kend = causal ? min(Sk, i0 + TQ) : Sk;"),
        ("    if (causal && j > i + 1) return 0;",
         "const int jend = causal ? min(i + 2, Sk) : Sk;",
         "for (int i = causal ? (j > 0 ? j - 1 : 0) : 0; i < Sq; ++i) {",
         "int ok = i < Sq && (!causal || i + 1 >= j0 + t);",
         "const int ibeg = causal ? ((j0 > 0 ? j0 - 1 : 0) / BLK) * BLK : 0;",
         "int ok = j < Sk && (!causal || j <= i + 1);",
         "const int kend = causal ? min(Sk, i0 + TQ + 1) : Sk;"), {}, "float32"),
    "attention_backward: lse from a different row": (
        "attention_backward", ("const PK_ACC_T lse = LSE[r];", "const PK_ACC_T lse = LSE[r];"),
        ("const PK_ACC_T lse = LSE[r > 0 ? r - 1 : r];",
         "const PK_ACC_T lse = LSE[r > 0 ? r - 1 : r];"), {}, "float32"),
    # rmsnorm is registered like any user op: its mutants run through its spec's own generator
    "rmsnorm: missing barrier in the reduction": (
        "rmsnorm", "            lb[lid] += lb[lid + step];\n        }\n        PK_BARRIER();",
        "            lb[lid] += lb[lid + step];\n        }", {"WG": 64}, "float32"),
    "rmsnorm: mean over n - 1": (
        "rmsnorm", "q = tn / nf + eps;", "q = tn / (nf - (PK_ACC_T)1) + eps;", {}, "float32"),
    "rmsnorm: large elements squared unscaled (overflow)": (
        "rmsnorm", "const PK_ACC_T t = x * down;", "const PK_ACC_T t = x;", {}, "float32"),
    "rmsnorm: the vector path never sums with Blue's split (overflow)": (
        "rmsnorm", "    if (any(isgreater(mx, (rvt)(big)))) {", "    if (0) {",
        {"WG": 1, "VEC": 8}, "float32"),
    "rmsnorm: the vector path drops one of its four partial sums": (
        "rmsnorm", "            p3 += x3 * x3;\n", "", {"WG": 1, "VEC": 8}, "float32"),
    "rmsnorm: bf16 accumulation": (
        "rmsnorm", "pn += x * x;", "pn = pk_bf16_to_float(pk_float_to_bf16(pn + x * x));", {},
        "bfloat16"),
}


_ALIVE: list[object] = []  # see test_mutant_is_caught


def kernel_targets() -> list[str]:
    from conftest import KERNEL_TARGETS

    return KERNEL_TARGETS


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name: str) -> None:
    op, old, new, cfg, dtype = MUTANTS[name]
    spec = get_op(op)
    source = spec.source
    # one edit, or several (a tuple of sites and a tuple of replacements) that make one mutant
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,))), strict=True):
        assert o in source, f"mutation site for {name!r} not found: the kernel changed"
        source = source.replace(o, n, 1)
    mutant = spec.replace(name=f"{op}_mutant", source=source)
    # Backends cache kernels and launch plans per spec token (process-unique, KernelSpec.token:
    # once id(spec), which a freed mutant handed to the next one with its compiled kernel).
    # Keeping every mutant alive costs little and keeps its cached kernel reachable.
    _ALIVE.append(mutant)
    targets = kernel_targets()
    if not targets:
        pytest.skip("no C-kernel backend available: " + str(
            {k: v["reason"] for k, v in pk.backends().items() if not v["available"]}))
    ran = 0
    for target in targets:
        be = selection.get(target)
        # a mutant of a vector path (VEC > 1) edits code a dialect without vector types
        # (CUDA, HIP) compiles out: it can only be caught where the path exists
        if int(cfg.get("VEC", 1)) > 1 and not codegen.DIALECTS[str(be.dialect)].vectors:
            continue
        ran += 1
        base = be.device_class
        config = {**spec.schedules[base], **cfg}
        ch = NumpyChooser(np.random.default_rng(1234))
        caught = False
        for _ in range(40):
            case = CASES[op](ch, dtype)
            out = pk.call(mutant, backend=target, config=config, **case.arrays, **case.params)
            if not compare(spec, case, out).ok:
                caught = True
                break
        assert caught, f"mutant {name!r} survived 40 cases on {target}"
    if not ran:
        pytest.skip(f"mutant {name!r} edits a vector path; no target here has vector types")


# --- mutants only the simulator catches --------------------------------------------------------
# Faults whose values come out right on PoCL (work-items run one after another, a read past an
# array lands in allocator slack, local memory holds yesterday's finite data), so the oracle
# cannot see them; on a GPU they give wrong answers now and then. The Oclgrind simulator
# (opencl:oclgrind, backend/test_simulator.py) reports each as a KernelFaultError of the named
# kind. Each entry: op, old, new, config, dtype, fixed cases, the fault kind it must raise.
SIMULATOR_MUTANTS = {
    # the last reduction step writes lm[0]/ls[0], which every item then reads: PoCL runs item
    # 0 first, so the others see the final value; on a GPU a warp may read it before
    "softmax: no barrier after the last reduction step (race, right values on PoCL)": (
        "softmax", "            ls[lid] = ss;\n        }\n        PK_BARRIER();\n    }",
        "            ls[lid] = ss;\n        }\n        if (step > 1) PK_BARRIER();\n    }",
        {"WG": 64, "VEC": 1, "UNROLL": 1, "STORE_EXP": 0}, "float32",
        (((3, 100),), ((2, 65),)), "race"),
    # a tile slot outside A reads one element past A's end and multiplies it by zero (fmin
    # keeps the product 0 even for NaN/inf slack): right values, an out-of-bounds read
    "matmul: local tile loads one past the end of A, times zero (out of bounds)": (
        "matmul",
        "As[kk][r] = (gr < M && gk < K) ? PK_LOAD_T(A, ao + gr * K + gk) : (PK_ACC_T)0;",
        "As[kk][r] = (gr < M && gk < K) ? PK_LOAD_T(A, ao + gr * K + gk)\n"
        "                : (PK_ACC_T)0 * fmin(fabs(PK_LOAD_T(A, ao + M * K)), (PK_ACC_T)1);",
        {"USE_LOCAL": 1, "LX": 8, "LY": 8, "TM": 2, "TN": 2, "TK": 8, "VEC": 1, "PACK_B": 0},
        "float32", (((5, 5), (5, 7)), ((19, 3), (3, 9))), "out-of-bounds"),
    # the A tile's slots past K are never written, yet read (times B's zeros) by the product
    "matmul: local A tile slots past K read before they are written (uninitialised)": (
        "matmul",
        "As[kk][r] = (gr < M && gk < K) ? PK_LOAD_T(A, ao + gr * K + gk) : (PK_ACC_T)0;",
        "if (gk < K) As[kk][r] = (gr < M) ? PK_LOAD_T(A, ao + gr * K + gk) : (PK_ACC_T)0;",
        {"USE_LOCAL": 1, "LX": 8, "LY": 8, "TM": 2, "TN": 2, "TK": 8, "VEC": 1, "PACK_B": 0},
        "float32", (((5, 5), (5, 7)), ((19, 3), (3, 9))), "uninitialised read"),
}

# What catches each mutant: the values (the oracle, on every C-kernel target) or the simulator.
CAUGHT_BY = {**{name: "values" for name in MUTANTS},
             **{name: "simulator" for name in SIMULATOR_MUTANTS}}


def _simulator_available() -> bool:
    try:
        from portakern.backend.oclgrind import simulator_info
    except Exception:
        return False
    return simulator_info() is not None


@pytest.mark.simulator
@pytest.mark.parametrize("name", sorted(SIMULATOR_MUTANTS))
def test_simulator_mutant_is_caught(name: str) -> None:
    op, old, new, cfg, dtype, shapes, kind = SIMULATOR_MUTANTS[name]
    assert CAUGHT_BY[name] == "simulator"
    spec = get_op(op)
    assert old in spec.source, f"mutation site for {name!r} not found: the kernel changed"
    mutant = spec.replace(name=f"{op}_sim_mutant", source=spec.source.replace(old, new, 1))
    _ALIVE.append(mutant)
    rng = np.random.default_rng(11)
    cases = [[rng.standard_normal(s).astype(dtype) for s in shape] for shape in shapes]
    config = {**spec.config("gpu"), **cfg}
    # the values need not catch it: on some C-kernel target the oracle accepts the mutant
    # (what an uninitialised read returns is the runtime's: PoCL's local memory holds earlier
    # finite data, while Intel's CPU runtime has been seen to return NaN there)
    missed = []
    for target in kernel_targets():
        if all(compare(spec, Case(dict(zip([o.name for o in spec.operands], arrays)), {}),
                       pk.call(mutant, *arrays, backend=target, config=config)).ok
               for arrays in cases):
            missed.append(target)
    assert missed or not kernel_targets(), f"{name!r} is caught by values on every target"
    if not _simulator_available():
        pytest.skip("opencl:oclgrind: the Oclgrind simulator is not installed")
    with pytest.raises(pk.KernelFaultError) as info:
        for arrays in cases:
            pk.call(mutant, *arrays, backend="opencl:oclgrind", config=config)
    assert info.value.kind == kind, str(info.value)
    assert info.value.source_line and info.value.work_items

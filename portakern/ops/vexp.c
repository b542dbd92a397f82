/* PK_VEXP(v): exp of a float vector for arguments x <= 0 (x - running max), shared by the
 * kernels whose CPU schedule is bound by exp (softmax, attention's online softmax). Slot T.
 *
 * The OpenCL builtin exp, called per vector, is far slower on a CPU device than this
 * straight-line form, table-driven as in Tang's method with an eighth-octave table:
 * x = (k/8) ln2 + r with k = round(8 x log2 e) and |r| <= ln2/16 (Cody-Waite: ln2/8 in two
 * parts, the first with few enough bits that k times it is exact); exp(x) = 2^(k >> 3) *
 * 2^((k & 7)/8) * exp(r), the middle factor from an 8-entry table (PK_LOOKUP8: one AVX2
 * vpermps on PoCL), exp(r) = 1 + r + c2 r^2 + c3 r^3 (minimax on the small interval). Three
 * polynomial steps where the whole-octave form needs six: the kernels that call this are
 * bound by its multiply-add chain on a CPU. Error at most 2.7u over 2.5e7 arguments in
 * [-87.33, 0] (u = 2^-24; tests/ops/test_vexp.py holds every device to the 8u the softmax and
 * attention tolerances assume); exp(0) is exactly 1.
 * Arguments below -87.33 give 0 (ln(FLT_MIN) is -87.3365: the true value is at most
 * 1.0007 FLT_MIN there, which the tolerance floor covers); -inf gives 0; NaN gives NaN. Valid
 * for x <= 88 (the kernels pass x - max <= 0; attention's backward s - lse, slightly above 0
 * at worst). Other accumulators (double) and dialects without vectors use the builtin.
 * k is rounded by adding 1.5 * 2^23 (the sum's low mantissa bits are then k itself, ties to
 * even): PoCL's vector rint is a dozen instructions of emulation, this is one add. */
#if VEC > 1 && PK_HAS_VECTOR && PK_ACC_IS_FLOAT_T
typedef PK_CAT(float, VEC) pk_fv;
typedef PK_CAT(int, VEC) pk_iv;
/* 2^(j/8) for j = 0..7 as float bits, less j << 20: adding (k << 20) then puts k >> 3 into
 * the exponent field and cancels the j the shift carries into the mantissa */
#define PK_EXP_TABLE as_float8((int8)(0x3f800000, 0x3f7b95c2, 0x3f7837f0, 0x3f75fed7, \
                                      0x3f7504f3, 0x3f75672a, 0x3f7744fd, 0x3f7ac0c7))
PK_DEVICE_FN pk_fv pk_exp_octave_eighths(pk_iv k)
{
#if VEC == 8
    return PK_LOOKUP8(PK_EXP_TABLE, k);
#elif VEC == 16 && !defined(PK_NO_LOOKUP8)
    return (pk_fv)(PK_LOOKUP8(PK_EXP_TABLE, k.lo), PK_LOOKUP8(PK_EXP_TABLE, k.hi));
#else /* (the simulator: one shuffle, no .hi; codegen.Dialect.lookup8) */
    return shuffle(PK_EXP_TABLE, PK_CAT(as_uint, VEC)(k));
#endif
}
PK_DEVICE_FN pk_fv pk_exp_nonpos(pk_fv x)
{
    const pk_fv shifted = fma(x, (pk_fv)(11.5415603271117073f), (pk_fv)(12582912.0f));
    const pk_fv k = shifted - (pk_fv)(12582912.0f);
    pk_fv r = fma(k, (pk_fv)(-0.086669921875f), x);
    r = fma(k, (pk_fv)(2.6524305e-5f), r);
    pk_fv p = fma((pk_fv)(0.166668579f), r, (pk_fv)(0.500064492f));
    p = fma(p, r, (pk_fv)(1.0f));
    p = fma(p, r, (pk_fv)(1.0f));
    /* the bits of shifted are 0x4B400000 + k: shifted left by 20 they are k << 20 */
    const pk_iv kb = PK_CAT(as_int, VEC)(shifted);
    const pk_fv scale = PK_CAT(as_float, VEC)(
        PK_CAT(as_int, VEC)(pk_exp_octave_eighths(kb)) + (kb << 20));
    return select(p * scale, (pk_fv)(0.0f), x < (pk_fv)(-87.33f));
}
#define PK_VEXP(v) pk_exp_nonpos(v)
#else
#define PK_VEXP(v) exp(v)
#endif

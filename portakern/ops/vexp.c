/* PK_VEXP(v): exp of a float vector for arguments x <= 0 (x - running max), shared by the
 * kernels whose CPU schedule is bound by exp (softmax, attention's online softmax). Slot T.
 *
 * The OpenCL builtin exp, called per vector, is far slower on a CPU device than this
 * straight-line form: Cody-Waite reduction x = n ln2 + r (|r| <= ln2/2, the product n*ln2_hi
 * exact), exp(r) = 1 + r + r^2 P(r) with a degree-5 minimax P (about 1 ulp), and 2^n built in
 * the exponent field. Arguments below ln(FLT_MIN) give 0 (the true value is under the smallest
 * normal float, which the tolerance floor covers); -inf gives 0; NaN gives NaN. Valid for
 * x <= 88. Other accumulators (double) and dialects without vectors use the builtin.
 * n is rounded by adding 1.5 * 2^23 (the sum's low mantissa bits are then n itself, ties to
 * even): PoCL's vector rint is a dozen instructions of emulation, this is one add. */
#if VEC > 1 && PK_HAS_VECTOR && PK_ACC_IS_FLOAT_T
typedef PK_CAT(float, VEC) pk_fv;
PK_DEVICE_FN pk_fv pk_exp_nonpos(pk_fv x)
{
    const pk_fv shifted = fma(x, (pk_fv)(1.44269504088896341f), (pk_fv)(12582912.0f));
    const pk_fv n = shifted - (pk_fv)(12582912.0f);
    pk_fv r = fma(n, (pk_fv)(-0.693359375f), x);
    r = fma(n, (pk_fv)(2.12194440e-4f), r);
    pk_fv p = (pk_fv)(1.9875691500e-4f);
    p = fma(p, r, (pk_fv)(1.3981999507e-3f));
    p = fma(p, r, (pk_fv)(8.3334519073e-3f));
    p = fma(p, r, (pk_fv)(4.1665795894e-2f));
    p = fma(p, r, (pk_fv)(1.6666665459e-1f));
    p = fma(p, r, (pk_fv)(5.0000001201e-1f));
    p = fma(p, r * r, r + (pk_fv)(1.0f));
    /* the bits of 1.5 * 2^23 + n are 0x4B400000 + n: 2^n = (n + 127) << 23 */
    const pk_fv scale = PK_CAT(as_float, VEC)(
        (PK_CAT(as_int, VEC)(shifted) - (0x4B400000 - 127)) << 23);
    return select(p * scale, (pk_fv)(0.0f), x < (pk_fv)(-87.33f));
}
#define PK_VEXP(v) pk_exp_nonpos(v)
#else
#define PK_VEXP(v) exp(v)
#endif

/* Attention's score modifiers and window, shared by the kernels that compute scores
 * (attention.c, paged_attention.c): the same formula in the same order as
 * attention_math.modify_scores / keep_matrix, so every kernel rounds alike.
 *
 * One compile-time switch, AT_MODS (0 or 1, from the spec's defines): 1 when the call uses any
 * modifier or a window. Which ones is run-time data, the kernel's `mods` argument (the
 * AT_BIT_* bits, attention.score_mods), so all fifteen combinations share one compiled
 * kernel per shape: a compile costs far more than a few tests per score. Without AT_MODS
 * every AT_HAS is the constant 0: the default kernel is the one without modifiers.
 *
 * AT_HAS(bit): that modifier is on (needs `mods` in scope). AT_HAS_MOD: a score modifier is.
 * at_modify(s, bias value, slope, qpos, kpos, cap, mods): s + bias, then
 * - slope * |qpos - kpos|, then cap * tanh(s / cap), each only where its bit is set. Callers
 * evaluate it only for keys the masks keep (a masked key scores -inf whatever its modifiers
 * give), and read the bias element only then (the element of a key past Sk does not exist).
 * at_in_window(qpos, kpos, left, right): qpos - left <= kpos <= qpos + right, written as
 * differences so no sum can overflow int (right is passed as Sk when the window has none).
 */
#ifndef AT_MODS
#define AT_MODS 0
#endif
#define AT_BIT_BIAS 1
#define AT_BIT_ALIBI 2
#define AT_BIT_CAP 4
#define AT_BIT_WIN 8
#define AT_HAS(bit) (AT_MODS && ((mods) & (bit)) != 0)
#define AT_HAS_MOD AT_HAS(AT_BIT_BIAS | AT_BIT_ALIBI | AT_BIT_CAP)

PK_DEVICE_FN PK_ACC_T at_modify(PK_ACC_T s, PK_ACC_T bias, PK_ACC_T slope, int qpos, int kpos,
                                PK_ACC_T cap, int mods)
{
    if (mods & AT_BIT_BIAS) s = s + bias;
    if (mods & AT_BIT_ALIBI) s = s - slope * (PK_ACC_T)(qpos > kpos ? qpos - kpos : kpos - qpos);
    if (mods & AT_BIT_CAP) {
        /* s itself where s / cap is 0 and s is not (a cap near the type's max on a device
         * that flushes subnormals: the value is s to under an ulp; attention_math.capped) */
        const PK_ACC_T u = s / cap;
        s = (u == (PK_ACC_T)0) ? s : cap * tanh(u);
    }
    return s;
}

PK_DEVICE_FN int at_in_window(int qpos, int kpos, int left, int right)
{
    return kpos - qpos >= -left && kpos - qpos <= right;
}

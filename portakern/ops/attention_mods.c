/* Attention's score modifiers and window, shared by the kernels that compute scores
 * (attention.c, paged_attention.c): the same formula in the same order as
 * attention_math.modify_scores / keep_matrix, so every kernel rounds alike.
 *
 * Compile-time switches (0 or 1, from the spec's defines): AT_BIAS (an additive bias array),
 * AT_ALIBI (per-head slopes), AT_CAP (the soft cap), AT_WIN (a sliding window). Off, they
 * cost nothing: the default kernel is the one without them.
 *
 * at_modify(s, bias value, slope, qpos, kpos, cap): s + bias, then - slope * |qpos - kpos|,
 * then cap * tanh(s / cap). Callers evaluate it only for keys the masks keep (a masked key
 * scores -inf whatever its modifiers give), and read the bias element only then (the
 * element of a key past Sk does not exist).
 * at_in_window(qpos, kpos, left, right): qpos - left <= kpos <= qpos + right, written as
 * differences so no sum can overflow int (right is passed as Sk when the window has none).
 */
#ifndef AT_BIAS
#define AT_BIAS 0
#endif
#ifndef AT_ALIBI
#define AT_ALIBI 0
#endif
#ifndef AT_CAP
#define AT_CAP 0
#endif
#ifndef AT_WIN
#define AT_WIN 0
#endif
#define AT_MOD (AT_BIAS || AT_ALIBI || AT_CAP)

PK_DEVICE_FN PK_ACC_T at_modify(PK_ACC_T s, PK_ACC_T bias, PK_ACC_T slope, int qpos, int kpos,
                                PK_ACC_T cap)
{
#if AT_BIAS
    s = s + bias;
#endif
#if AT_ALIBI
    s = s - slope * (PK_ACC_T)(qpos > kpos ? qpos - kpos : kpos - qpos);
#endif
#if AT_CAP
    s = cap * tanh(s / cap);
#endif
    return s;
}

PK_DEVICE_FN int at_in_window(int qpos, int kpos, int left, int right)
{
    return kpos - qpos >= -left && kpos - qpos <= right;
}

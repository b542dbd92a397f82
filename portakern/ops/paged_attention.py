"""paged_attention(q, k_cache, v_cache, block_table, seq_lens, ...): decode attention over a
paged KV cache (vLLM's PagedAttention layout), split-K when the context is long.

Shapes: q (B, Hq, Sq, D), Sq >= 1 new tokens per sequence; k_cache (NB, Hkv, BS, D) and
v_cache (NB, Hkv, BS, Dv), a pool of NB pages of BS tokens; block_table (B, MB) int32, row b
the pages of sequence b in order (token t in page block_table[b, t // BS], slot t % BS);
seq_lens (B,) int32, the tokens in the cache per sequence, the Sq new ones included. Output
(B, Hq, Sq, Dv). Query i of sequence b sits at position seq_lens[b] - Sq + i and attends
cache positions <= its own: causal, aligned bottom-right (decode, speculative decode).
window / softcap / alibi_slopes as in ``attention``, in those positions; bias broadcasts to
(B, Hq, Sq, MB * BS) and is indexed by cache position (entries past a sequence's length are
never read). GQA: Hkv divides Hq.

Why its own op rather than a gather before ``attention``: the gather would copy the whole
cache per step; here every page is read in place, once per kv head for all the query heads
that share it, which is what bounds decode (memory traffic, not flops).

Semantics (the oracle): gather each sequence's pages, then ``attention.semantics`` with the
bottom-right causal/window keep matrix as its mask and ALiBi's term folded into its bias
(``attention_math.keep_matrix`` / ``modify_scores`` with ``q_offset``): the same non-finite
rules, one formula. The tolerance and the statistical model are attention's, of that same
gathered call (plus the one rounding folding ALiBi hides).

Table values are checked on the host before any device work (``check_tables``, called by
``pk.paged_attention``): validation sees shapes only. Whatever the tables hold, the kernel
never reads out of bounds (lengths clamped to [0, MB*BS], block ids to [0, NB)) and the
semantics clamp alike, so even an unchecked call (``pk.call``, or traced values under
``jax.jit``) is defined and agrees across backends.

Split-K (flash-decoding): ``fit_device`` (the spec hook runtime.configs calls with the
device's compute units) turns SPLIT = 0 into enough key splits that the call's groups
(B * Hkv * row blocks) fill every compute unit SPLIT_GROUPS_PER_UNIT times, each split at
least MIN_SPLIT_KEYS keys; ``SPLIT`` > 0 forces a count (1 = unsplit; 0 without a device,
e.g. a tool rendering source, reads as 1). Split s owns pages [s*pps, (s+1)*pps);
each writes (max, sum, accumulator) to workspaces and ``paged_attention_combine`` merges them
in split order: deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core import dtypes
from ..core.dtypes import dtype_name
from ..core.errors import InvalidArgumentError, PortakernError, ShapeError
from ..core.sampling import Case, Chooser, normal
from ..core.spec import (
    MAX_INDEX,
    ArrayMeta,
    Buf,
    Cost,
    KernelSpec,
    Launch,
    Operand,
    Problem,
    Scalar,
    Tunable,
)
from . import attention
from ._common import broadcast_strides, cdiv, kernel_source, need_rank
from .attention_math import keep_matrix, modify_scores

MIN_SPLIT_KEYS = 256  # fewer keys per split would cost more in partials than it gains
COMBINE_WG = 64
LAYOUT = {"q": "(B, Hq, Sq, D)", "k_cache": "(num_blocks, Hkv, block_size, D)",
          "v_cache": "(num_blocks, Hkv, block_size, Dv)", "block_table": "(B, max_blocks)",
          "seq_lens": "(B,)"}


# --- semantics ----------------------------------------------------------------------------
def gather(xp: Any, cache: Any, block_table: Any) -> Any:
    """(NB, H, BS, X) pages -> (B, H, MB * BS, X): each sequence's pages in table order. Block
    ids are clamped to [0, NB), as the kernel clamps them (an unused entry may hold anything)."""
    nb, h, bs, x = cache.shape
    b, mb = block_table.shape
    ids = xp.clip(block_table, 0, max(nb - 1, 0))
    g = xp.take(cache, xp.reshape(ids, (-1,)), axis=0)
    g = xp.transpose(xp.reshape(g, (b, mb, h, bs, x)), (0, 2, 1, 3, 4))
    return xp.reshape(g, (b, h, mb * bs, x))


def positions(xp: Any, seq_lens: Any, sq: int, capacity: int) -> Any:
    """The position of query 0 per sequence, (B, 1, 1, 1): seq_len - Sq, the length clamped to
    [0, capacity] as the kernel clamps it."""
    lens = xp.clip(seq_lens, 0, capacity)
    return xp.reshape(lens - sq, (-1, 1, 1, 1))


def keep_and_bias(xp: Any, sq: int, capacity: int, seq_lens: Any, window: Any, bias: Any,
                  alibi_slopes: Any, dtype: Any) -> tuple[Any, Any]:
    """(keep (B, 1, Sq, cap), the additive bias with ALiBi folded in, or None): the paged
    positions (bottom-right) through attention_math's one formula for each."""
    off = positions(xp, seq_lens, sq, capacity)
    keep = keep_matrix(xp, sq, capacity, True, None, window, off)
    if alibi_slopes is not None:
        base = xp.zeros((1, 1, sq, capacity), dtype=dtype)
        if bias is not None:
            base = base + bias
        bias = modify_scores(xp, base, None, alibi_slopes, None, off)
    return keep, bias


def semantics(xp: Any, q: Any, k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any,
              bias: Any = None, alibi_slopes: Any = None, scale: float | None = None,
              softcap: float | None = None, window: tuple[int, int | None] | None = None
              ) -> Any:
    """Gather the pages, then attention's semantics with the paged (bottom-right) keep
    matrix as its mask and ALiBi folded into its bias."""
    sq = q.shape[2]
    capacity = block_table.shape[1] * k_cache.shape[2]
    k = gather(xp, k_cache, block_table)
    v = gather(xp, v_cache, block_table)
    keep, total = keep_and_bias(xp, sq, capacity, seq_lens, window, bias, alibi_slopes, q.dtype)
    return attention.semantics(xp, q, k, v, mask=keep, bias=total, scale=scale,
                               softcap=softcap)


# --- validation ---------------------------------------------------------------------------
def _param(fn: Any, value: object) -> Any:
    """attention's parameter checks, their errors naming this op."""
    try:
        return fn(value)
    except PortakernError as exc:
        raise type(exc)(str(exc).replace("attention:", "paged_attention:", 1)) from None


def validate(m: dict[str, ArrayMeta | None], params: dict[str, Any]) -> Problem:
    q, kc, vc, bt, sl = (m[n] for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens"))
    bias, slopes = m.get("bias"), m.get("alibi_slopes")
    assert q is not None and kc is not None and vc is not None and bt is not None
    assert sl is not None
    for name, meta, rank in (("q", q, 4), ("k_cache", kc, 4), ("v_cache", vc, 4),
                             ("block_table", bt, 2), ("seq_lens", sl, 1)):
        need_rank("paged_attention", name, meta.shape, rank=rank, layout=LAYOUT[name])
    B, Hq, Sq, D = q.shape
    NB, Hkv, BS, Dk = kc.shape
    NBv, Hv, BSv, Dv = vc.shape
    Bt, MB = bt.shape
    if Dk != D:
        raise ShapeError(f"paged_attention: k_cache head dim {Dk} differs from q's {D}; "
                         f"expected k_cache {LAYOUT['k_cache']} with q's D.")
    if (NBv, Hv, BSv) != (NB, Hkv, BS):
        raise ShapeError(f"paged_attention: v_cache {vc.shape} must match k_cache {kc.shape} "
                         f"in blocks, heads and block size; expected v_cache {LAYOUT['v_cache']}.")
    if Bt != B or sl.shape[0] != B:
        raise ShapeError(f"paged_attention: block_table {bt.shape} and seq_lens {sl.shape} "
                         f"must have one row per sequence of q {q.shape} (B = {B}); expected "
                         f"block_table (B, max_blocks) and seq_lens (B,).")
    if Hkv == 0 or Hq % Hkv:
        raise ShapeError(f"paged_attention: query heads Hq={Hq} must be a multiple of the "
                         f"cache's kv heads Hkv={Hkv}; got q {q.shape}, k_cache {kc.shape}.")
    if B * Sq > 0 and (BS == 0 or NB == 0 or MB == 0):
        raise ShapeError(f"paged_attention: a call with queries needs pages: got k_cache "
                         f"{kc.shape} and block_table {bt.shape}; expected num_blocks, "
                         "block_size and max_blocks >= 1.")
    params["scale"] = _param(lambda v: attention.checked_scale(v, D), params.get("scale"))
    params["window"] = _param(attention.checked_window, params.get("window"))
    params["softcap"] = _param(attention.checked_softcap, params.get("softcap"))
    cap = MB * BS
    bstr = [0, 0, 0, 0]
    if bias is not None:
        target = (B, Hq, Sq, cap)
        try:
            ok = len(bias.shape) <= 4 and tuple(np.broadcast_shapes(bias.shape, target)) == target
        except ValueError:
            ok = False
        if not ok:
            raise ShapeError(f"paged_attention: bias of shape {bias.shape} does not broadcast "
                             f"to (B, Hq, Sq, max_blocks * block_size) = {target}; its last "
                             "axis is the cache position.")
        bstr = broadcast_strides(bias.shape, target, 1)
    if slopes is not None and tuple(slopes.shape) != (Hq,):
        raise ShapeError(f"paged_attention: alibi_slopes has shape {tuple(slopes.shape)}; "
                         f"expected (Hq,) = ({Hq},), one float32 slope per query head.")
    out = (B, Hq, Sq, Dv)
    return Problem("paged_attention", dtype_name(q.dtype),
                   {"q": q.shape, "k_cache": kc.shape, "v_cache": vc.shape,
                    "block_table": bt.shape, "seq_lens": sl.shape,
                    "bias": None if bias is None else bias.shape,
                    "alibi_slopes": None if slopes is None else slopes.shape}, params, out,
                   derived={"B": B, "Hq": Hq, "Hkv": Hkv, "Sq": Sq, "D": D, "Dv": Dv,
                            "NB": NB, "BS": BS, "MB": MB, "bias_strides": bstr},
                   empty_result=0 in out)


def host_table(x: Any) -> np.ndarray | None:
    """A host copy of an int table for ``check_tables``: numpy as is; device arrays (pyopencl,
    CuPy: ``.get()``; jax: ``np.asarray``) copied, which costs one small download per call
    (B + B * max_blocks ints). None where the values are unknown (a jax tracer under jit)."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__ or ""
    try:
        if mod.startswith(("pyopencl", "cupy")):
            return np.asarray(x.get())
        return np.asarray(x)
    except Exception:  # traced (jax.jit): nothing to check now; the kernel clamps
        return None


def native_int32(t: np.ndarray | None) -> np.ndarray | None:
    """A big-endian int32 table (``>i4``: validation reads it as int32, and the kernels get
    native values) in native order, so its values are checked too (they were skipped, and a
    block id past the pool went through)."""
    if t is not None and t.dtype.kind == "i" and t.dtype.itemsize == 4 and not t.dtype.isnative:
        return t.astype(np.int32)
    return t


def check_tables(block_table: Any, seq_lens: Any, num_blocks: int, block_size: int,
                 sq: int) -> None:
    """Refuse bad table values before any device work, naming the first bad entry:
    Sq <= seq_lens[b] <= max_blocks * block_size, and every block a sequence uses
    (block_table[b, :ceil(seq_lens[b] / block_size)]) in [0, num_blocks). Entries past a
    sequence's pages are never read and may hold anything (vLLM pads with -1 or 0).
    Malformed tables (rank, dtype, lengths) are left to validation, which names them."""
    bt, sl = native_int32(host_table(block_table)), native_int32(host_table(seq_lens))
    if bt is None or sl is None or bt.ndim != 2 or sl.ndim != 1 or sl.shape[0] != bt.shape[0] \
            or bt.dtype != np.int32 or sl.dtype != np.int32:
        return
    mb = bt.shape[1]
    hi = mb * block_size
    bad = np.flatnonzero((sl < sq) | (sl > hi))
    if bad.size:
        b = int(bad[0])
        raise InvalidArgumentError(
            f"paged_attention: seq_lens[{b}] = {int(sl[b])} is outside [Sq, max_blocks * "
            f"block_size] = [{sq}, {hi}]; a sequence holds its Sq = {sq} new tokens and at most "
            f"its {mb} blocks of {block_size}. Fix: append the new tokens' keys and values "
            "to the cache first and count them in seq_lens, or give block_table more columns.")
    used = (sl.astype(np.int64) + block_size - 1) // block_size
    col = np.arange(mb)[None, :]
    wrong = (col < used[:, None]) & ((bt < 0) | (bt >= num_blocks))
    if wrong.any():
        b, j = (int(i) for i in np.argwhere(wrong)[0])
        raise InvalidArgumentError(
            f"paged_attention: block_table[{b}, {j}] = {int(bt[b, j])} is outside [0, "
            f"{num_blocks}) (num_blocks of the cache); sequence {b} has seq_lens[{b}] = "
            f"{int(sl[b])} tokens in its first {int(used[b])} blocks. Fix: point every used "
            "entry at a page of k_cache/v_cache (entries past them are never read).")


def check_operand_values(arrays: Mapping[str, Any]) -> None:
    """The spec's ``check_values``: ``check_tables`` with the sizes read from the operands'
    shapes (a malformed shape is left to validation, which names it)."""
    q, k = arrays.get("q"), arrays.get("k_cache")
    shape_q, shape_k = getattr(q, "shape", None), getattr(k, "shape", None)
    if shape_q is None or shape_k is None or len(shape_q) != 4 or len(shape_k) != 4:
        return
    table = getattr(arrays.get("block_table"), "shape", None)
    if shape_q[0] * shape_q[2] > 0 and (shape_k[0] == 0 or shape_k[2] == 0
                                        or (table is not None and 0 in tuple(table)[1:])):
        return  # queries and no pages: validation's ShapeError says so, not a range of [2, 0]
    check_tables(arrays.get("block_table"), arrays.get("seq_lens"), int(shape_k[0]),
                 int(shape_k[2]), int(shape_q[2]))


# --- schedule: rows per group, splits -----------------------------------------------------
def rows_per_group(p: Problem, cfg: Mapping[str, int]) -> int:
    """RB, compile-time: the schedule's, or fewer when the kv head has fewer rows (G * Sq,
    rounded up to a power of two so few distinct kernels are compiled)."""
    r = max(1, p.derived["Hq"] // max(p.derived["Hkv"], 1) * p.derived["Sq"])
    return min(cfg["RB"], 1 << (r - 1).bit_length())


def heads_per_group(p: Problem, cfg: Mapping[str, int]) -> int:
    """HEADS, compile-time: the kv heads one work-group takes (at most Hkv; 0, unresolved by
    a device, e.g. a tool rendering source, reads as 1). The CPU path takes every page for
    all of them in turn, reading each block's heads side by side (docs/decode.md); the last
    group of a sequence may hold fewer."""
    return max(1, min(cfg.get("HEADS", 1), p.derived["Hkv"]))


def groups_per_split(p: Problem, cfg: Mapping[str, int]) -> int:
    """Work-groups of one split: sequences x groups of heads x blocks of rows."""
    d = p.derived
    r = d["Hq"] // max(d["Hkv"], 1) * d["Sq"]
    return (d["B"] * cdiv(max(d["Hkv"], 1), heads_per_group(p, cfg))
            * cdiv(max(r, 1), rows_per_group(p, cfg)))


SPLIT_GROUPS_PER_UNIT = 2  # split until the groups fill each compute unit this many times
MAX_AUTO_HEADS = 8  # HEADS = 0 takes at most this many (8: 1.2-1.4x from memory on a Zen 4)
# below this many bytes of pages a call's cache is likely in the last-level cache, where a
# group of heads buys no locality and one head a group ran 5-15% faster (16 MiB on a Zen 4
# with a 32 MiB L3; at 32 MiB the group was 1.0-1.1x faster: docs/decode.md)
HEADS_MIN_BYTES = 32 << 20


def page_bytes(p: Problem) -> int:
    """The K and V pages a call may read: every sequence at its table's capacity."""
    d = p.derived
    return (d["B"] * d["Hkv"] * d["MB"] * d["BS"] * (d["D"] + d["Dv"])
            * p.info.storage.itemsize)


def auto_heads(p: Problem, cfg: Mapping[str, int], compute_units: int) -> int:
    """HEADS = 0: one head a group when the pages are fewer than HEADS_MIN_BYTES; else the
    most kv heads a group (MAX_AUTO_HEADS, halved) for which the call's groups, times the
    splits it may take (SPLIT's if forced, else as many as keep MIN_SPLIT_KEYS keys each),
    still fill each compute unit SPLIT_GROUPS_PER_UNIT times: the locality of a group of
    heads never costs a core its work (a B1 call forced unsplit on 2 cores takes 2, 64 cores
    at 4096 tokens take 1)."""
    if page_bytes(p) < HEADS_MIN_BYTES:
        return 1
    d = p.derived
    split = cfg.get("SPLIT", 0)
    most = splits(p, cfg)[0] if split > 0 else max(1, min(d["MB"] * d["BS"] // MIN_SPLIT_KEYS,
                                                          128))
    want = SPLIT_GROUPS_PER_UNIT * compute_units
    h = MAX_AUTO_HEADS
    while h > 1 and groups_per_split(p, {**cfg, "HEADS": h}) * most < want:
        h //= 2
    return h


def fit_device(p: Problem, cfg: dict[str, int], compute_units: int) -> dict[str, int]:
    """The spec's ``fit_device``: HEADS = 0 becomes ``auto_heads``; then SPLIT = 0 becomes
    the number of key splits (a power of two in the tunable's domain) that fills each of the
    device's compute units SPLIT_GROUPS_PER_UNIT times over with the call's groups, keeping
    at least MIN_SPLIT_KEYS keys per split: decode at small batch on a GPU splits, a large
    batch or a short context does not, nor a CPU whose few cores the groups already fill."""
    if cfg.get("HEADS") == 0:
        cfg["HEADS"] = auto_heads(p, cfg, compute_units)
    if cfg.get("SPLIT") != 0:
        return cfg
    d = p.derived
    groups = groups_per_split(p, cfg)
    want = min(cdiv(SPLIT_GROUPS_PER_UNIT * compute_units, max(groups, 1)),
               d["MB"] * d["BS"] // MIN_SPLIT_KEYS, 128)
    cfg["SPLIT"] = 1 << (max(want, 1).bit_length() - 1)
    return cfg


def splits(p: Problem, cfg: Mapping[str, int]) -> tuple[int, int]:
    """(number of splits, pages per split): SPLIT (0, unresolved by a device, reads as 1),
    capped at the pages and at 32-bit indexing of the partials; no split left empty."""
    d = p.derived
    mb = max(d["MB"], 1)
    ns = max(1, min(cfg["SPLIT"], mb))
    rows = d["B"] * d["Hq"] * d["Sq"]
    while ns > 1 and ns * rows * max(d["Dv"], 1) > MAX_INDEX:
        ns //= 2
    pps = cdiv(mb, ns)
    return cdiv(mb, pps), pps


def pages_per_chunk(p: Problem, cfg: Mapping[str, int]) -> int:
    """PAGES, compile-time: the schedule's, or (PAGES = 0) as many pages as fill a chunk of
    VEC keys when a page holds fewer: VEC / the largest power of two <= BS (pages of 8 tokens
    under 16 lanes: 2 pages a chunk, where one left half the lanes idle; 1.6x in cache on a
    Zen 4, docs/decode.md). Never more than VEC (the kernel clamps too: a group of more
    pages than a chunk's lanes would skip the pages past them)."""
    vec, bs = max(cfg["VEC"], 1), max(p.derived["BS"], 1)
    if cfg.get("PAGES", 0):
        return min(cfg["PAGES"], vec)  # a chunk of VEC keys spans at most VEC pages
    return max(1, vec // min(vec, 1 << (bs.bit_length() - 1)))


def _store_kind(dtype: str) -> int:
    return {"float16": 1, "bfloat16": 2}.get(dtype, 0)


def defines(p: Problem, cfg: Mapping[str, int]) -> dict[str, Any]:
    return {"WG": cfg["WG"], "VEC": cfg["VEC"], "RB": rows_per_group(p, cfg),
            "HEADS": heads_per_group(p, cfg),
            "ACC": cfg["ACC"], "PF": cfg.get("PF", 0),
            "PAGES": pages_per_chunk(p, cfg),
            "DQ": p.derived["D"], "DV": p.derived["Dv"], "PA_ST": _store_kind(p.dtype),
            "PA_SPLIT": int(splits(p, cfg)[0] > 1),
            "AT_MODS": int(attention.score_mods(p) != 0)}


def workspace(p: Problem, cfg: Mapping[str, int]) -> dict[str, tuple[int, str]]:
    ns, _ = splits(p, cfg)
    if ns == 1:
        return {}
    d = p.derived
    rows = d["B"] * d["Hq"] * d["Sq"]
    acc = dtypes.compute_dtype_name(p.dtype)
    return {"pm": (ns * rows, acc), "pl": (ns * rows, acc), "pa": (ns * rows * d["Dv"], acc)}


def launches(p: Problem, cfg: Mapping[str, int]) -> list[Launch]:
    d = p.derived
    ns, pps = splits(p, cfg)
    rb = rows_per_group(p, cfg)
    nrb = cdiv(d["Hq"] // d["Hkv"] * d["Sq"], rb)
    rows = d["B"] * d["Hq"] * d["Sq"]
    cap = d["MB"] * d["BS"]
    window = p.params.get("window")
    left, right = window if window is not None else (0, None)
    bs = d["bias_strides"]
    split = ns > 1
    ws = ("pm", "pl", "pa") if split else ("out", "out", "out")  # unwritten when unsplit
    args: tuple[Buf | Scalar, ...] = (
            Buf("q"), Buf("k_cache"), Buf("v_cache"), Buf("block_table"), Buf("seq_lens"),
            Buf("bias" if p.shapes.get("bias") is not None else "q"),
            Buf("alibi_slopes" if p.shapes.get("alibi_slopes") is not None else "q"),
            Buf("out"), *(Buf(n) for n in ws),
            Scalar(d["Sq"]), Scalar(d["Hq"]), Scalar(d["Hkv"]), Scalar(d["NB"]),
            Scalar(d["BS"]), Scalar(d["MB"]), Scalar(nrb), Scalar(ns), Scalar(pps),
            Scalar(rows), Scalar(p.params["scale"], "acc"), Scalar(min(left, cap)),
            Scalar(cap if right is None else min(right, cap)),
            Scalar(p.params.get("softcap") or 1.0, "acc"), Scalar(attention.score_mods(p)),
            Scalar(bs[0]), Scalar(bs[1]), Scalar(bs[2]), Scalar(bs[3]))
    groups = d["B"] * cdiv(d["Hkv"], heads_per_group(p, cfg)) * nrb
    out = [Launch("paged_attention", (groups * ns, 1, 1), (cfg["WG"], 1, 1),
                  args)]
    if split:
        out.append(Launch("paged_attention_combine", (cdiv(rows * d["Dv"], COMBINE_WG), 1, 1),
                          (COMBINE_WG, 1, 1), (Buf("pm"), Buf("pl"), Buf("pa"), Buf("out"),
                                               Scalar(rows), Scalar(ns))))
    return out


def cost(p: Problem) -> Cost:
    """Compulsory traffic with every sequence at its table's capacity (MB * BS tokens: the
    values of seq_lens are not known here): q, the K/V rows some query attends once per kv
    head (all of them, unless a window leaves some out), the output."""
    d = p.derived
    cap = d["MB"] * d["BS"]
    isz = p.info.storage.itemsize
    pairs = attention.attended_pairs(d["Sq"], cap, True, p.params.get("window"), cap - d["Sq"])
    # the pages a window leaves out are never read (the kernel starts at the window's page)
    keys = attention.attended_keys(d["Sq"], cap, True, p.params.get("window"), cap - d["Sq"])
    bh = d["B"] * d["Hq"]
    width = d["D"] + d["Dv"]
    nbytes = isz * (bh * d["Sq"] * width + d["B"] * d["Hkv"] * keys * width)
    return Cost(flops=2.0 * bh * pairs * (d["D"] + d["Dv"]), bytes=float(nbytes))


# --- error model: attention's, of the gathered call ---------------------------------------
def as_attention(p: Problem, x: Mapping[str, np.ndarray]
                 ) -> tuple[Problem, dict[str, np.ndarray], np.ndarray]:
    """The gathered call as ``attention`` sees it, on float64 inputs: its problem, its inputs
    (mask = the paged keep matrix, bias = bias + ALiBi) cut to the longest sequence, and
    ALiBi's extra rounding per row (folding it into the bias hides one: the kernel rounds
    s + bias, then subtracts slope * |i - j|), bounded by u (2 |slope d| + |s| + |bias|)."""
    d = p.derived
    sq, cap = d["Sq"], d["MB"] * d["BS"]
    lens = np.clip(x["seq_lens"].astype(np.int64), 0, cap)
    sk = max(1, int(lens.max()) if lens.size else 1)
    k = gather(np, x["k_cache"], x["block_table"])[:, :, :sk]
    v = gather(np, x["v_cache"], x["block_table"])[:, :, :sk]
    bias, slopes = x.get("bias"), x.get("alibi_slopes")
    if bias is not None:
        bias = np.broadcast_to(bias, (d["B"], d["Hq"], sq, cap))[..., :sk]
    keep, total = keep_and_bias(np, sq, sk, lens.astype(np.int32), p.params.get("window"),
                                bias, slopes, np.float64)
    keep = np.broadcast_to(keep, (d["B"], 1, sq, sk))
    xa: dict[str, np.ndarray] = {"q": x["q"], "k": k, "v": v, "mask": keep}
    if total is not None:
        xa["bias"] = total
    metas: dict[str, ArrayMeta | None] = {n: ArrayMeta(a.shape, p.dtype) for n, a in xa.items()}
    metas["mask"] = ArrayMeta(keep.shape, "bool")
    metas.setdefault("bias", None)
    params = {"causal": False, "scale": p.params["scale"], "return_lse": False,
              "window": None, "softcap": p.params.get("softcap")}
    pa = attention.validate(metas, params)
    extra = np.zeros((d["B"], d["Hq"], sq, 1))
    if slopes is not None:
        u = attention.u_of(p)
        g = d["Hq"] // d["Hkv"]
        with np.errstate(all="ignore"):
            s = np.matmul(x["q"] * p.params["scale"], np.swapaxes(np.repeat(k, g, 1), -1, -2))
            fin = np.where(np.isfinite(s), np.abs(s), 0.0) + np.where(
                np.isfinite(total), np.abs(total), 0.0)
            fin = fin + 2.0 * np.abs(slopes.reshape(1, -1, 1, 1)) * float(cap)
            extra = u * np.where(keep, fin, 0.0).max(axis=-1, keepdims=True)
    return pa, xa, extra


def _vmax(xa: Mapping[str, np.ndarray], g: int) -> np.ndarray:
    """max |v| over each sequence's attended keys, (B, Hq, 1, Dv): bounds sum_j p_j |v_j|."""
    v = np.repeat(np.where(np.isfinite(xa["v"]), np.abs(xa["v"]), 0.0), g, axis=1)
    keep = np.asarray(xa["mask"].any(axis=2))[..., None]  # (B, 1, Sk, 1)
    return np.where(keep, v, 0.0).max(axis=2, keepdims=True) if v.shape[2] else \
        np.zeros(v.shape[:2] + (1, v.shape[3]))


def tolerance(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> np.ndarray:
    """attention's worst-case bound of the gathered call (attention.worst_case_bounds), plus ALiBi's
    extra rounding: an error e in a score moves the output by at most 2 e sum_j p_j |v_j|."""
    pa, xa, extra = as_attention(p, x)
    bound = attention.worst_case_bounds(pa, xa, ref, None)[0]
    g = p.derived["Hq"] // p.derived["Hkv"]
    return bound + 2.0 * extra * _vmax(xa, g)


def statistical(p: Problem, x: dict[str, np.ndarray], ref: np.ndarray) -> Any:
    """attention's statistical model of the gathered call, ALiBi's extra rounding in the
    slack."""
    from ..core.statmodel import StatModel

    pa, xa, extra = as_attention(p, x)
    sm = attention.statistical(pa, xa, ref)
    g = p.derived["Hq"] // p.derived["Hkv"]
    return StatModel(sm.sigma, sm.slack + 2.0 * extra * _vmax(xa, g), sm.group_axes)


# --- cases ----------------------------------------------------------------------------------
def tables(rng: np.random.Generator, ch: Chooser, b: int, mb: int, bs: int, sq: int
           ) -> tuple[np.ndarray, np.ndarray, int, str]:
    """(block_table, seq_lens, num_blocks, note): ragged lengths in [Sq, MB*BS] (some not a
    multiple of BS), pages drawn from a shuffled pool of B*MB + 3 (permuted), sometimes shared
    between sequences (a common prefix), unused entries sometimes garbage (-1, huge). All of
    it values: the shapes stay those of the layout."""
    lens = rng.integers(sq, mb * bs + 1, size=b)
    if ch.boolean(0.3):
        lens[rng.integers(b)] = mb * bs  # a full row
    nb = b * mb + 3
    bt = rng.permutation(nb)[:b * mb].reshape(b, mb)
    note = f"lens{lens.tolist()} bs{bs} nb{nb}"
    if b > 1 and ch.boolean(0.3):
        share = int(rng.integers(1, mb + 1))
        bt[1:, :share] = bt[0, :share]
        note += f" shared{share}"
    if ch.boolean(0.3):
        used = -(-lens // bs)
        for i in range(b):
            bt[i, used[i]:] = ch.choice((-1, 10**6))
        note += " padded"
    return bt.astype(np.int32), lens.astype(np.int32), nb, note


# (B, Hq, Hkv, Sq, D, Dv, block_size, max_blocks): a few layouts, so the suite's draws
# (lengths, tables, values, modifiers) reuse compiled kernels and XLA executables
LAYOUTS = (
    (3, 8, 2, 1, 32, 32, 16, 6),  # GQA decode, ragged lengths
    (2, 4, 4, 1, 16, 16, 4, 12),  # multi-head, small pages
    (1, 4, 1, 3, 32, 32, 5, 8),  # multi-query, speculative (Sq = 3), pages of 5
    # D = 8 (the CPU's scalar path), Dv != D, pages of 4: partial last pages there (with
    # pages of one token, a mutant dropping a partial page's last token survived)
    (2, 2, 1, 2, 8, 16, 4, 5),
    (2, 2, 1, 2, 32, 32, 1, 20),  # pages of one token on the vector path: a chunk of 16 pages
    (1, 2, 2, 1, 32, 32, 16, 1),  # one page
)


def paged_case(ch: Chooser, dtype: str) -> Case:
    rng = np.random.default_rng(ch.seed())
    b, hq, hkv, sq, d, dv, bs, mb = ch.choice(LAYOUTS)
    bt, lens, nb, note = tables(rng, ch, b, mb, bs, sq)
    x = {"q": normal(rng, (b, hq, sq, d), dtype),
         "k": normal(rng, (nb, hkv, bs, d), dtype), "v": normal(rng, (nb, hkv, bs, dv), dtype)}
    kind = ch.choice(("plain", "plain", "plain", "nonfinite", "magnitude"))
    if kind == "nonfinite":
        note += attention.nonfinite_entries(ch, rng, x)
    elif kind == "magnitude":
        x = {n: normal(rng, a.shape, dtype, 1e2) for n, a in x.items()}
        note += " magnitude"
    scale = None if ch.boolean(0.7) else ch.choice((0.05, 0.5, 2.0))
    extra, mods, mod_note = attention.score_mod_case(ch, rng, dtype, b, hq, sq, mb * bs)
    mods = {k: v for k, v in mods.items() if k in ("window", "softcap")}
    return Case({"q": x["q"], "k_cache": x["k"], "v_cache": x["v"], "block_table": bt,
                 "seq_lens": lens, **extra}, {"scale": scale, **mods},
                (f"B{b} Hq{hq} Hkv{hkv} Sq{sq} D{d} Dv{dv} " + note + mod_note).strip())


# --- representative calls -----------------------------------------------------------------
def example(dtype: str, *, B: int = 1, Hq: int = 32, Hkv: int = 8, Sq: int = 1, D: int = 128,
            BS: int = 16, MB: int = 32) -> tuple[dict[str, Any], dict[str, Any]]:
    """A decode step (Llama-3-8B's heads, a 512-token context in pages of 16). Kept small:
    registering the op evaluates its float64 semantics on this example (a 4096-token one
    cost every `import portakern` 0.5 s); the compile checks use longer ones (examples)."""
    nb = B * MB
    return ({"q": ArrayMeta((B, Hq, Sq, D), dtype), "k_cache": ArrayMeta((nb, Hkv, BS, D), dtype),
             "v_cache": ArrayMeta((nb, Hkv, BS, D), dtype),
             "block_table": ArrayMeta((B, MB), "int32"), "seq_lens": ArrayMeta((B,), "int32")},
            {})


def examples(dtype: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Compile checks: the decode step unsplit (B8) and split (B1: few groups), a
    speculative-decode step with every modifier."""
    ex1, _ = example(dtype, B=8, MB=256)
    ex2, _ = example(dtype, B=1, MB=2048)
    ex3, _ = example(dtype, B=2, Sq=4, MB=256)
    ex3 = {**ex3, "bias": ArrayMeta((1, 32, 4, 256 * 16), dtype),
           "alibi_slopes": ArrayMeta((32,), "float32")}
    return [("decode B8", ex1, {}), ("decode B1 32k", ex2, {}),
            ("spec Sq4 mods", ex3, {"window": 128, "softcap": 50.0})]


SPEC = KernelSpec(
    name="paged_attention",
    operands=(Operand("q"), Operand("k_cache"), Operand("v_cache"),
              Operand("block_table", kind="int32"), Operand("seq_lens", kind="int32"),
              Operand("bias", optional=True),
              Operand("alibi_slopes", kind="float32", optional=True)),
    params={"scale": None, "softcap": None, "window": None},
    validate=validate,
    semantics=semantics,
    source=kernel_source("vexp.c", "attention_mods.c", "paged_attention.c"),
    slots=lambda p: {"T": p.dtype},
    defines=defines,
    launches=launches,
    workspace=workspace,
    cost=cost,
    tolerance=tolerance,
    statistical=statistical,
    tunables=(Tunable("WG", (1, 32, 64, 128, 256), "work-items per group (keys per tile on "
                      "the scalar path)"),
              Tunable("VEC", (1, 4, 8, 16), "vector lanes over D and keys per chunk (CPU "
                      "path: WG = 1, OpenCL)"),
              Tunable("RB", (1, 2, 4, 8, 16), "query rows (heads sharing a kv head x Sq) "
                      "per work-group"),
              Tunable("ACC", (4, 8, 16, 32), "P.V accumulator vectors held in registers "
                      "(CPU path): each of the RB rows keeps ACC / RB (at least 1) of its "
                      "DV / VEC"),
              Tunable("SPLIT", (0, 1, 2, 4, 8, 16, 32, 64, 128), "key splits: 0 from the "
                      "device's compute units, 1 unsplit, n forced"),
              Tunable("PF", (0, 1), "the next chunk's prefetch (CPU path): 0 non-temporal "
                      "(prefetchnta), 1 into the outer caches (prefetcht2)"),
              Tunable("PAGES", (0, 1, 2, 4, 8, 16), "pages read side by side (CPU path): a "
                      "chunk's VEC keys are VEC / PAGES slots of each of PAGES consecutive "
                      "pages; 0: enough pages to fill the chunk when a page is shorter"),
              Tunable("HEADS", (0, 1, 2, 4, 8, 16), "kv heads per work-group: the CPU path "
                      "reads each page for all of them in turn (a block's heads side by "
                      "side); 0: up to 8, as many as still give every compute unit its "
                      "groups")),
    schedules={"gpu": {"WG": 128, "VEC": 1, "RB": 8, "ACC": 16, "SPLIT": 0, "PF": 0, "PAGES": 0,
                       "HEADS": 1},
               # CPU: VEC 16 (zmm on AVX-512; 8 is 15-20% slower at 32768 tokens there);
               # the next chunk into L2 (PF 1: 1.5-1.9x on a Zen 4); a page for up to 8 kv
               # heads in turn (HEADS 8: 1.2-1.4x from memory on a Zen 4, docs/decode.md)
               "cpu": {"WG": 1, "VEC": 16, "RB": 8, "ACC": 16, "SPLIT": 0, "PF": 1,
                       "PAGES": 0, "HEADS": 0},
               # AVX2: ymm vectors, and 16 of them: P.V keeps 8 accumulators, not 16 (which
               # spilled: 10-20% slower, docs/decode.md); prefetchnta measured best there
               "cpu256": {"WG": 1, "VEC": 8, "RB": 8, "ACC": 8, "SPLIT": 0, "PF": 0,
                          "PAGES": 0, "HEADS": 0}},
    fit_device=fit_device,
    check_values=check_operand_values,
    unspecified_nonfinite=True,
    cases=paged_case,
    example=example,
    examples=examples,
    doc="Decode attention over a paged KV cache (block table, per-sequence lengths), "
        "split-K; GQA, window, softcap, bias, ALiBi.",
)

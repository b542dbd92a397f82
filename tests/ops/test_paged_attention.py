"""pk.paged_attention: the float64 oracle against a loop over the pages written here, every
backend against the oracle (ragged lengths, lengths not a multiple of the block size,
permuted and shared block tables, GQA, speculative decode, the modifiers), split-K forced on
and off, bad tables refused before any device work, Oclgrind (never an out-of-bounds read,
even with tables no check has seen), and mutants of the kernel caught.

The shared suites (tests/ops/test_ops.py, tests/backend/test_simulator.py) draw the op's own
cases (paged_attention.paged_case) too; these are the fixed cases a reader can follow."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.core.sampling import Case
from portakern.ops import get_op
from portakern.ops import paged_attention as pa
from portakern.runtime import selection

from _oracle import compare_case
from conftest import KERNEL_TARGETS, require_simulator

SPEC = get_op("paged_attention")
SIM = "opencl:oclgrind"
_ALIVE: list[Any] = []  # mutant specs stay alive: backends cache kernels per spec


def paged(rng: np.random.Generator, *, B: int, Hq: int, Hkv: int, Sq: int, D: int, BS: int,
          MB: int, lens: list[int], dtype: str = "float32", Dv: int | None = None,
          share: int = 0, pad: int | None = -1) -> dict[str, np.ndarray]:
    """A pool of B * MB + 3 pages handed out in a shuffled order (a permuted table); the
    first ``share`` pages of sequence 0 also start every other sequence (a shared prefix);
    entries past a sequence's pages hold ``pad`` (None: leave the drawn ids)."""
    nb = B * MB + 3
    bt = rng.permutation(nb)[:B * MB].reshape(B, MB)
    if share:
        bt[1:, :share] = bt[0, :share]
    if pad is not None:
        for b, n in enumerate(lens):
            bt[b, -(-n // BS):] = pad
    dv = Dv or D
    return {"q": rng.standard_normal((B, Hq, Sq, D)).astype(dtype),
            "k_cache": rng.standard_normal((nb, Hkv, BS, D)).astype(dtype),
            "v_cache": rng.standard_normal((nb, Hkv, BS, dv)).astype(dtype),
            "block_table": bt.astype(np.int32), "seq_lens": np.array(lens, np.int32)}


def loop_reference(a: dict[str, np.ndarray], scale: float | None = None,
                   window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """The op by its definition, one query at a time in float64: walk the sequence's pages,
    key position t in page t // BS, query i at position seq_len - Sq + i."""
    q, kc, vc = (a[n].astype(np.float64) for n in ("q", "k_cache", "v_cache"))
    bt, lens = a["block_table"], a["seq_lens"]
    B, Hq, Sq, D = q.shape
    Hkv, BS = kc.shape[1], kc.shape[2]
    bias, slopes = a.get("bias"), a.get("alibi_slopes")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = np.zeros((B, Hq, Sq, vc.shape[-1]))
    for b in range(B):
        L = int(lens[b])
        for h in range(Hq):
            kvh = h // (Hq // Hkv)
            for i in range(Sq):
                pos = L - Sq + i
                keys = [t for t in range(pos + 1) if window is None or t >= pos - window]
                s = np.array([np.dot(q[b, h, i] * scale, kc[bt[b, t // BS], kvh, t % BS])
                              for t in keys])
                if bias is not None:
                    s = s + np.broadcast_to(bias, (B, Hq, Sq, bt.shape[1] * BS))[b, h, i, keys]
                if slopes is not None:
                    s = s - float(slopes[h]) * np.abs(pos - np.array(keys))
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                p = np.exp(s - s.max())
                vs = np.stack([vc[bt[b, t // BS], kvh, t % BS] for t in keys])
                out[b, h, i] = p @ vs / p.sum()
    return out


def check(arrays: dict[str, Any], params: dict[str, Any], target: str,
          config: dict[str, int] | None = None) -> np.ndarray:
    got = pk.paged_attention(**arrays, **params, backend=target, config=config)
    got = np.asarray(got)
    v = compare_case(SPEC, Case(arrays, params, "fixed"), got, target)
    assert v.ok, f"paged_attention on {target} {config} {params}:\n{v}"
    return got


def ragged(dtype: str = "float32") -> dict[str, np.ndarray]:
    """GQA 8/2, lengths 1 (one key), 37 (not a multiple of 16) and 96 (full), a shared first
    page, padded rows."""
    return paged(np.random.default_rng(0), B=3, Hq=8, Hkv=2, Sq=1, D=32, BS=16, MB=6,
                 lens=[1, 37, 96], dtype=dtype, share=1)


def with_mods() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Speculative decode (Sq = 3), GQA 4/2, block size 5, a window, a soft cap, ALiBi and a
    per-head bias over cache positions."""
    rng = np.random.default_rng(1)
    a = paged(rng, B=2, Hq=4, Hkv=2, Sq=3, D=32, BS=5, MB=8, lens=[23, 40])
    a["bias"] = rng.standard_normal((1, 4, 1, 40)).astype(np.float32)
    a["alibi_slopes"] = (2.0 ** -np.arange(1, 5)).astype(np.float32)
    return a, {"window": 11, "softcap": 5.0}


def test_the_oracle_is_the_loop_over_pages() -> None:
    a = ragged()
    ref = SPEC.semantics(np, *(a[n].astype(np.float64) if a[n].dtype.kind == "f" else a[n]
                               for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens")))
    np.testing.assert_allclose(ref, loop_reference(a), rtol=1e-12, atol=1e-12)
    m, params = with_mods()
    f64 = {k: v.astype(np.float64) if v.dtype.kind == "f" and k != "alibi_slopes" else v
           for k, v in m.items()}
    ref = SPEC.semantics(np, **f64, window=(11, None), softcap=5.0)
    np.testing.assert_allclose(ref, loop_reference(m, window=11, softcap=5.0), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_ragged_permuted_gqa_matches_the_oracle(target: str, dtype: str) -> None:
    check(ragged(dtype), {}, target)


def test_speculative_decode_with_every_modifier(target: str) -> None:
    a, params = with_mods()
    check(a, params, target)


def test_modifier_values_at_the_edges_of_their_types(target: str) -> None:
    """A window of 2**31 - 1 on both sides and the largest cap change nothing (jax: int32
    positions overflowed, and XLA flushed the subnormal s / c to 0; test_attention_numerics)."""
    a = ragged()
    got = check(a, {"window": (2**31 - 1, 2**31 - 1), "softcap": 2.0**126}, target)
    np.testing.assert_allclose(got, check(a, {}, target), rtol=1e-5, atol=1e-6)


# the CPU vector path unsplit and split, the GPU scalar path (WG 32: tiles of 32 keys) split
SPLIT_CONFIGS = [{"SPLIT": 1}, {"SPLIT": 4}, {"SPLIT": 128},
                 # the next chunk's hint: non-temporal (cpu256's) and into L2 (cpu's)
                 {"PF": 0, "SPLIT": 1}, {"PF": 1, "SPLIT": 4},
                 # the P.V register budget: one accumulator vector per row (ACC < RB), and
                 # four per row (two groups of D / VEC = 8)
                 {"VEC": 8, "ACC": 4, "SPLIT": 1}, {"VEC": 4, "ACC": 32, "SPLIT": 4},
                 # a chunk's keys from 2 or 4 pages side by side; 40 pages in 4 splits of
                 # 10: each split's last group of 4 pages has 2 past the split's end
                 {"PAGES": 2, "SPLIT": 1}, {"PAGES": 4, "SPLIT": 4},
                 {"PAGES": 4, "VEC": 8, "SPLIT": 1},
                 # one key a page (VEC 4, PAGES 4), and more pages asked than lanes (16 > 8)
                 {"PAGES": 4, "VEC": 4, "SPLIT": 1}, {"PAGES": 16, "VEC": 8, "SPLIT": 4},
                 {"WG": 32, "VEC": 1, "RB": 4, "SPLIT": 1},
                 {"WG": 32, "VEC": 1, "RB": 4, "SPLIT": 8}]


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()))
def test_split_forced_on_and_off(kernel_target: str, config: dict[str, int]) -> None:
    """A 600-token context in 40 pages: unsplit, 4 and 40 splits (SPLIT 128 is capped at the
    pages), on both paths; each matches the oracle and a split run repeats bit for bit (the
    combine adds the splits in a fixed order)."""
    be = selection.get(kernel_target)
    cfg = {**SPEC.schedules[be.device_class], **config}
    a = paged(np.random.default_rng(2), B=1, Hq=4, Hkv=1, Sq=2, D=32, BS=16, MB=40,
              lens=[600])
    got = check(a, {}, kernel_target, cfg)
    again = np.asarray(pk.paged_attention(**a, backend=kernel_target, config=cfg))
    np.testing.assert_array_equal(got, again)
    prob = SPEC.problem(a, dict(SPEC.params))
    ns, pps = pa.splits(prob, cfg)
    assert ns == (1 if cfg["SPLIT"] == 1 else min(cfg["SPLIT"], 40)) and ns * pps >= 40
    assert len(SPEC.launches(prob, cfg)) == (1 if ns == 1 else 2)


@pytest.mark.parametrize("config", [{"VEC": 8, "ACC": 16}, {"VEC": 4, "ACC": 32}],
                         ids=["VEC8-ACC16", "VEC4-ACC32"])
def test_a_head_size_the_register_groups_do_not_divide(kernel_target: str,
                                                      config: dict[str, int]) -> None:
    """D = 40: 5 (VEC 8) or 10 (VEC 4) accumulator vectors per row, in groups of ACC / RB =
    2 or 4 for the 8 rows of this kv head, so P.V's last group is partial and only its
    `c0 + i < NAV` guards keep it inside the row."""
    be = selection.get(kernel_target)
    cfg = {**SPEC.schedules[be.device_class], "SPLIT": 1, **config}
    a = paged(np.random.default_rng(5), B=2, Hq=4, Hkv=1, Sq=2, D=40, BS=16, MB=12,
              lens=[150, 37])
    check(a, {}, kernel_target, cfg)


def three_heads() -> dict[str, np.ndarray]:
    """Two sequences (190 and 77 tokens) of 3 kv heads, GQA 6/3, Sq = 2: groups of 2 heads
    leave a last group of one, so a group's sequence and heads both come from its id."""
    return paged(np.random.default_rng(7), B=2, Hq=6, Hkv=3, Sq=2, D=32, BS=16, MB=12,
                 lens=[190, 77])


# kv heads per work-group: groups of 2 (2 + 1), 4 (one group of 3), 16 (clamped to 3), with
# splits, pages side by side, and on the scalar path (its heads one after another)
HEAD_CONFIGS = [{"HEADS": 1, "SPLIT": 1}, {"HEADS": 2, "SPLIT": 1}, {"HEADS": 2, "SPLIT": 4},
                {"HEADS": 4, "SPLIT": 1}, {"HEADS": 16, "SPLIT": 2},
                {"HEADS": 2, "PAGES": 2, "SPLIT": 1}, {"HEADS": 4, "VEC": 8, "SPLIT": 4},
                # two blocks of 2 rows a kv head (RB 2), in groups of 2 heads
                {"HEADS": 2, "RB": 2, "SPLIT": 2},
                {"WG": 32, "VEC": 1, "RB": 4, "HEADS": 2, "SPLIT": 1},
                {"WG": 32, "VEC": 1, "RB": 4, "HEADS": 4, "SPLIT": 4}]


@pytest.mark.parametrize("config", HEAD_CONFIGS, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()))
def test_groups_of_kv_heads(kernel_target: str, config: dict[str, int]) -> None:
    """A work-group of HEADS kv heads reads each page for all of them in turn: every head's
    rows match the oracle however the heads are grouped, and the launch has one group per
    sequence, group of heads, block of rows and split."""
    be = selection.get(kernel_target)
    cfg = {**SPEC.schedules[be.device_class], **config}
    a = three_heads()
    check(a, {}, kernel_target, cfg)
    prob = SPEC.problem(a, dict(SPEC.params))
    heads = min(config["HEADS"], 3)
    assert pa.heads_per_group(prob, cfg) == heads
    ns, _ = pa.splits(prob, cfg)
    nrb = -(-4 // pa.rows_per_group(prob, cfg))  # 2 query heads x Sq 2 rows a kv head
    assert SPEC.launches(prob, cfg)[0].groups[0] == 2 * -(-3 // heads) * nrb * ns


def test_automatic_pages_fill_the_chunk() -> None:
    """PAGES = 0: a chunk of VEC keys takes as many pages as it needs when a page is
    shorter than the chunk (pages of 8 under 16 lanes: 2; of 12: 2, slots 8-15 of the
    second chunk dead), one when a page is as long or longer; a forced PAGES stays."""
    def pages(bs: int, vec: int, forced: int = 0) -> int:
        ex, _ = pa.example("float16", B=1, MB=8, BS=bs)
        prob = SPEC.problem(ex, dict(SPEC.params))
        return pa.pages_per_chunk(prob, {**SPEC.schedules["cpu"], "VEC": vec, "PAGES": forced})

    assert [pages(bs, 16) for bs in (1, 4, 8, 12, 16, 32)] == [16, 4, 2, 2, 1, 1]
    assert pages(8, 8) == 1 and pages(4, 8) == 2 and pages(16, 16, forced=4) == 4
    assert pages(16, 8, forced=16) == 8  # never more pages than a chunk has lanes


def test_automatic_split_follows_the_compute_units() -> None:
    """SPLIT = 0 (fit_device): a long context with few groups splits until they fill each
    compute unit twice, a short one or a large batch does not, no split has fewer than
    MIN_SPLIT_KEYS keys; without a device SPLIT = 0 reads as unsplit."""
    def fitted(B: int, ctx: int, units: int) -> int:
        ex, _ = pa.example("float16", B=B, MB=ctx // 16)
        prob = SPEC.problem(ex, dict(SPEC.params))
        cfg = pa.fit_device(prob, dict(SPEC.schedules["gpu"]), units)
        return pa.splits(prob, cfg)[0]

    assert fitted(1, 32768, 132) == 32  # 8 groups; 264 wanted: 33, a power of two below
    assert fitted(1, 1024, 132) == 1024 // pa.MIN_SPLIT_KEYS
    assert fitted(1, 256, 132) == 1
    assert fitted(64, 4096, 132) == 1  # 512 groups already
    assert fitted(1, 32768, 2) == 1  # one kv head a group: the 8 kv heads fill 2 cores

    def fitted_cpu(B: int, ctx: int, units: int, split: int = 0) -> tuple[int, int]:
        """(HEADS, splits) the CPU schedule (HEADS = 0) takes."""
        ex, _ = pa.example("float16", B=B, MB=ctx // 16)
        prob = SPEC.problem(ex, dict(SPEC.params))
        cfg = pa.fit_device(prob, {**SPEC.schedules["cpu"], "SPLIT": split}, units)
        return pa.heads_per_group(prob, cfg), pa.splits(prob, cfg)[0]

    # HEADS = 0: up to 8 kv heads a group while every core keeps 2 groups: B1 on 2 cores
    # holds all 8 in one group and splits in 4; forced unsplit it takes 2 heads (4 groups);
    # 64 cores at 32768 tokens, 8 heads and 128 splits; at 8192 (32 MiB), 2 (4 x 32 splits)
    assert fitted_cpu(1, 32768, 2) == (8, 4) and fitted_cpu(8, 32768, 2) == (8, 1)
    assert fitted_cpu(1, 32768, 2, split=1) == (2, 1)
    assert fitted_cpu(1, 32768, 64) == (8, 128) and fitted_cpu(1, 8192, 64) == (2, 32)
    assert fitted_cpu(1, 8192, 2) == (8, 4)  # 32 MiB of pages: HEADS_MIN_BYTES
    # fewer bytes of pages (likely in cache): one head a group, as before HEADS
    assert fitted_cpu(1, 4096, 2) == (1, 1) and fitted_cpu(1, 4096, 64) == (1, 16)
    assert fitted_cpu(8, 256, 2) == (1, 1)
    ex, _ = pa.example("float16", B=1, MB=64)
    prob = SPEC.problem(ex, dict(SPEC.params))
    assert pa.heads_per_group(prob, SPEC.schedules["cpu"]) == 1  # no device: one head
    ex, _ = pa.example("float16", B=1, MB=2048)
    prob = SPEC.problem(ex, dict(SPEC.params))
    assert pa.splits(prob, dict(SPEC.schedules["gpu"])) == (1, 2048)
    assert pa.splits(prob, {**SPEC.schedules["gpu"], "SPLIT": 8}) == (8, 256)


BAD = [
    ("block_table", (1, 2), 97, "block_table[1, 2] = 97 is outside [0, 21)"),
    ("block_table", (2, 0), -1, "block_table[2, 0] = -1 is outside [0, 21)"),
    ("seq_lens", (1,), 97, "seq_lens[1] = 97 is outside [Sq, max_blocks * block_size] = [1, 96]"),
    ("seq_lens", (0,), 0, "seq_lens[0] = 0 is outside [Sq, max_blocks * block_size] = [1, 96]"),
]


@pytest.mark.parametrize("name,index,value,words", BAD, ids=[b[3][:20] for b in BAD])
def test_bad_tables_are_refused_before_any_device_work(name: str, index: tuple[int, ...],
                                                      value: int, words: str) -> None:
    a = ragged()
    a[name] = a[name].copy()
    a[name][index] = value
    be = selection.get("opencl:0") if "opencl:0" in KERNEL_TARGETS else selection.get("numpy")
    before = be.transfers.h2d
    with pytest.raises(pk.InvalidArgumentError) as info:
        pk.paged_attention(**a, backend=be)
    assert words in str(info.value) and "Fix:" in str(info.value)
    with pytest.raises(pk.InvalidArgumentError, match=re.escape(words)):  # the spec's own check
        pk.call("paged_attention", **a, backend=be)
    assert be.transfers.h2d == before  # nothing was uploaded


def test_malformed_tables_are_refused_by_validation() -> None:
    a = ragged()
    with pytest.raises(pk.DTypeError, match="block_table.*int32"):
        pk.paged_attention(**{**a, "block_table": a["block_table"].astype(np.int64)},
                           backend="numpy")
    with pytest.raises(pk.ShapeError, match="one row per sequence"):
        pk.paged_attention(**{**a, "seq_lens": np.array([1, 2, 3, 4], np.int32)},
                           backend="numpy")
    with pytest.raises(pk.ShapeError, match="v_cache"):
        pk.paged_attention(**{**a, "v_cache": a["v_cache"][:, :, :8]}, backend="numpy")
    with pytest.raises(pk.ShapeError, match="max_blocks \\* block_size"):
        pk.paged_attention(**a, bias=np.zeros((8, 1, 95), np.float32), backend="numpy")
    with pytest.raises(pk.InvalidArgumentError, match="paged_attention: window"):
        pk.paged_attention(**a, window=-1, backend="numpy")
    # big-endian tables (validation reads them as int32) get their values checked too
    with pytest.raises(pk.InvalidArgumentError, match="block_table"):
        bad = a["block_table"].copy()
        bad[0, 0] = 10**6
        pk.paged_attention(**{**a, "block_table": bad.astype(">i4")}, backend="numpy")
    with pytest.raises(pk.InvalidArgumentError, match="seq_lens"):
        pk.paged_attention(**{**a, "seq_lens": (a["seq_lens"] + 10**6).astype(">i4")},
                           backend="numpy")
    # queries and no pages (no blocks, pages of 0 tokens, an empty table): the shape's
    # error, not a table value's "outside [2, 0]"
    for edit in ({"k_cache": a["k_cache"][:0], "v_cache": a["v_cache"][:0]},
                 {"k_cache": a["k_cache"][:, :, :0], "v_cache": a["v_cache"][:, :, :0]},
                 {"block_table": a["block_table"][:, :0]}):
        with pytest.raises(pk.ShapeError, match="needs pages"):
            pk.paged_attention(**{**a, **edit}, backend="numpy")


def test_device_tables_are_checked_from_a_host_copy() -> None:
    if "opencl:0" not in KERNEL_TARGETS:
        pytest.skip("opencl:0 absent")
    be = selection.get("opencl:0")
    a = ragged()
    dev = {k: be.to_native(v) for k, v in a.items()}
    out = pk.paged_attention(**dev, backend=be)
    assert be.is_native(out)
    np.testing.assert_array_equal(be.to_numpy(out), pk.paged_attention(**a, backend=be))
    bad = a["block_table"].copy()
    bad[1, 2] = 1000
    with pytest.raises(pk.InvalidArgumentError, match=r"block_table\[1, 2\] = 1000"):
        pk.paged_attention(**{**dev, "block_table": be.to_native(bad)}, backend=be)


def test_jax_jit_composes() -> None:
    jax = pytest.importorskip("jax")
    a = ragged()
    ref = np.asarray(pk.paged_attention(**a, backend="numpy"))

    @jax.jit
    def step(q: Any, kc: Any, vc: Any, bt: Any, sl: Any) -> Any:
        return pk.paged_attention(q, kc, vc, bt, sl, softcap=30.0) * 2.0

    got = step(*(jax.numpy.asarray(a[n]) for n in ("q", "k_cache", "v_cache", "block_table",
                                                   "seq_lens")))
    capped = np.asarray(pk.paged_attention(**a, softcap=30.0, backend="numpy"))
    np.testing.assert_allclose(np.asarray(got) / 2.0, capped, rtol=2e-5, atol=2e-6)
    assert np.abs(capped - ref).max() > 0  # the cap was applied


# --- Oclgrind: the kernels as a GPU runs them, every access checked -------------------------
def _simulator() -> None:
    require_simulator()


_UNCHECKED: list[object] = []


@pytest.mark.simulator
@pytest.mark.parametrize("schedule", ["cpu", "gpu"])
def test_simulator_groups_of_kv_heads(schedule: str) -> None:
    """Groups of 2 kv heads over 3 (the last group holds one) on Oclgrind, unsplit and
    split: no access out of bounds or uninitialised, and the oracle's values."""
    _simulator()
    a = paged(np.random.default_rng(4), B=2, Hq=3, Hkv=3, Sq=2, D=16, BS=4, MB=5,
              lens=[6, 20])
    cfg = {**SPEC.schedules[schedule], "HEADS": 2}
    for split in (1, 2):
        check(a, {}, SIM, {**cfg, "SPLIT": split, "WG": min(cfg["WG"], 32)})


@pytest.mark.simulator
@pytest.mark.parametrize("schedule", ["gpu", "cpu", "cpu256", "cpu-PAGES4", "cpu-PAGES16",
                                      "cpu256-PAGES16"])
def test_simulator_split_and_unchecked_bad_tables(schedule: str) -> None:
    """Unsplit and split on Oclgrind; then tables no check has seen (a copy of the spec
    without check_values): ids past the pool, negative ids, lengths past the table.
    Oclgrind raises on any out-of-bounds access; the kernel clamps as the semantics do, so
    they still agree."""
    _simulator()
    rng = np.random.default_rng(3)
    a = paged(rng, B=2, Hq=2, Hkv=1, Sq=2, D=16, BS=4, MB=5, lens=[6, 20], pad=None)
    name, _, pages = schedule.partition("-PAGES")
    cfg = {**SPEC.schedules[name], **({"PAGES": int(pages)} if pages else {})}
    for split in (1, 2):
        check(a, {}, SIM, {**cfg, "SPLIT": split, "WG": min(cfg["WG"], 32)})
    bad = {**a, "block_table": a["block_table"].copy(), "seq_lens": np.array([-5, 99], np.int32)}
    bad["block_table"][0, 0] = -7
    bad["block_table"][1, 4] = 10**6
    unchecked = SPEC.replace(name="paged_attention_unchecked", check_values=None)
    _UNCHECKED.append(unchecked)  # alive: backends key their caches on the spec's id
    got = pk.call(unchecked, **bad, backend=SIM,
                  config={**cfg, "SPLIT": 2, "WG": min(cfg["WG"], 32)})
    v = compare_case(SPEC, Case(bad, {}, "unchecked"), got, SIM)
    assert v.ok, str(v)


def with_bad_v(a: dict[str, np.ndarray], *entries: tuple[int, int, int, float]
               ) -> dict[str, np.ndarray]:
    """``a`` with sequence 0's V entries (position, kv head, column) set to the values."""
    a = dict(a)
    v = a["v_cache"].copy()
    bs = v.shape[2]
    for pos, head, col, value in entries:
        v[a["block_table"][0, pos // bs], head, pos % bs, col] = value
    a["v_cache"] = v
    return a


def nonfinite_v(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Sequence 0 of ``paged(..., B=1, BS=8, lens=[600])``: an inf in the V row at position 83
    (every query attends it), a NaN in the V row at 599 (only the last query, at 599, attends
    it: the query at 598 must stay finite)."""
    return with_bad_v(a, (83, 0, 5, np.inf), (599, 0, 7, np.nan))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nonfinite_v_rows_poison_exactly_the_rows_that_attend_them(kernel_target: str,
                                                                   dtype: str) -> None:
    """Attention's rule: a kept key whose V row holds a NaN or an inf makes the row NaN (not
    inf, not a NaN in one column); a row that does not attend it stays finite. The CPU
    schedule finds such a chunk by its accumulators and redoes it exactly."""
    a = nonfinite_v(paged(np.random.default_rng(2), B=1, Hq=4, Hkv=1, Sq=2, D=32, BS=8,
                          MB=80, lens=[600], dtype=dtype))
    got = check(a, {}, kernel_target)
    assert np.isnan(got[0, :, 1]).all() and np.isnan(got[0, :, 0]).all()
    got = check(with_bad_v(a, (83, 0, 5, 0.0)), {}, kernel_target)  # only the NaN at 599
    assert np.isnan(got[0, :, 1]).all() and np.isfinite(got[0, :, 0]).all()


def nonfinite_heads(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``three_heads()`` with a NaN in kv head 1's V row at position 189 (only sequence 0's
    last query attends it) and an inf in kv head 2's at position 40 (both of its queries)."""
    return with_bad_v(a, (189, 1, 3, np.nan), (40, 2, 9, np.inf))


@pytest.mark.parametrize("config", [{"HEADS": 2, "SPLIT": 1}, {"HEADS": 4, "SPLIT": 2},
                                    {"WG": 32, "VEC": 1, "RB": 4, "HEADS": 4, "SPLIT": 1}],
                         ids=["HEADS2", "HEADS4-SPLIT2", "scalar-HEADS4"])
def test_nonfinite_v_rows_poison_their_own_heads_rows(kernel_target: str,
                                                      config: dict[str, int]) -> None:
    """In a group of kv heads, a bad V row poisons the rows of its own kv head's query heads
    (2 per kv head here) that attend it, and no other head's."""
    be = selection.get(kernel_target)
    got = check(nonfinite_heads(three_heads()), {}, kernel_target,
                {**SPEC.schedules[be.device_class], **config})
    assert np.isfinite(got[0, 0:2]).all() and np.isfinite(got[1]).all()  # kv head 0; seq 1
    assert np.isfinite(got[0, 2:4, 0]).all() and np.isnan(got[0, 2:4, 1]).all()  # kv head 1
    assert np.isnan(got[0, 4:6]).all()  # kv head 2: both queries attend position 40


# --- mutants: faults the oracle must catch ----------------------------------------------------
MUTANTS = {
    "the combine drops the last split": (
        "    for (int s = 0; s < nsplit; ++s) {\n        const PK_ACC_T w",
        "    for (int s = 0; s < nsplit - 1; ++s) {\n        const PK_ACC_T w", {"SPLIT": 4}),
    "a query does not attend its own position (off by one)": (
        "#define PA_AT_OR_BEFORE(kp, qp) ((kp) <= (qp))",
        "#define PA_AT_OR_BEFORE(kp, qp) ((kp) < (qp))",
        {"SPLIT": 1}),
    "query positions aligned top-left": (
        "const int q0pos = L - Sq;", "const int q0pos = 0;", {"SPLIT": 1}),
    # the CPU schedule's register-blocked chunk (VEC 16: the default there)
    "the accumulators miss the rescale when the running max rises": (
        "acc[hh][r][c] *= (pa_vt)(corr);", "acc[hh][r][c] *= (pa_vt)(1.0f);",
        {"SPLIT": 1, "VEC": 16}),
    "the score tree pairs partial sums of two keys": (
        "PA_SH(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18",
        "PA_SH(a, b, 2, 0, 4, 6, 8, 10, 12, 14, 16, 18", {"SPLIT": 1, "VEC": 16}),
    "P.V skips every other group of accumulator vectors": (
        "for (int c0 = 0; c0 < NAV; c0 += PA_CG) {",
        "for (int c0 = 0; c0 < NAV; c0 += 2 * PA_CG) {", {"SPLIT": 1, "VEC": 8, "ACC": 8}),
    # (its case gets non-finite V rows: CASE_EDITS)
    "P.V never redoes a chunk whose V rows hold a NaN or an inf": (
        "if (!all(isequal(bad - bad, (pa_vt)(0.0f)))) {", "if (0) {",
        {"SPLIT": 1, "VEC": 8, "ACC": 8}),
    "a chunk longer than the page keeps lanes past the page's last key": (
        "            live &= lslot < (pa_it)(BS - t0);\n", "",
        {"SPLIT": 1, "VEC": 16, "PAGES": 1}),
    # a chunk's keys from several pages (PAGES)
    "every lane of a chunk reads the group's first page": (
        "(nku_ > 0 ? (PA_BLOCK(pu_) * Hkv", "(nku_ > 0 ? (PA_BLOCK(gp) * Hkv",
        {"SPLIT": 1, "VEC": 16, "PAGES": 4}),
    # groups of kv heads (HEADS; their case: three_heads, CASE_EDITS)
    "every head of a group reads its first head's pages": (
        "        kvh = kvh0 + hh;\n        for (int t0", "        kvh = kvh0;\n        for (int t0",
        {"SPLIT": 1, "VEC": 16, "HEADS": 4}),
    "a sequence's last group of heads (fewer than HEADS) runs none": (
        "min(HEADS, Hkv - kvh0)", "min(HEADS, Hkv) - kvh0", {"SPLIT": 1, "VEC": 16, "HEADS": 2}),
    "the scalar path runs a group's first head for every head": (
        "    kvh = kvh0 + hh;\n    for (int t = 0; t < PA_OPI", "    for (int t = 0; t < PA_OPI",
        {"SPLIT": 1, "WG": 32, "VEC": 1, "RB": 4, "HEADS": 2}),
    "a bad V row poisons its group's first head's rows": (
        "poison[hh][r] |= PA_KEEP", "poison[0][r] |= PA_KEEP", {"SPLIT": 1, "VEC": 16, "HEADS": 4}),
    "a split's last group keeps lanes of pages past the split's end": (
        "            live &= lpage < (pa_it)(p_hi - pg);\n", "",
        {"SPLIT": 8, "VEC": 16, "PAGES": 4}),  # 10 pages a split: groups of 4, 4, 2
}


# mutants whose fault only shows on a case edited so (the others keep the plain case)
CASE_EDITS = {"P.V never redoes a chunk whose V rows hold a NaN or an inf": nonfinite_v,
              **{name: lambda _: three_heads() for name in (
                  "every head of a group reads its first head's pages",
                  "a sequence's last group of heads (fewer than HEADS) runs none",
                  "the scalar path runs a group's first head for every head")},
              "a bad V row poisons its group's first head's rows":
                  lambda _: nonfinite_heads(three_heads())}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_caught(name: str) -> None:
    if not KERNEL_TARGETS:
        pytest.skip("no C-kernel backend")
    old, new, cfg = MUTANTS[name]
    assert SPEC.source.count(old) == 1, f"mutation site for {name!r} not found"
    mutant = SPEC.replace(name="paged_attention_mutant", source=SPEC.source.replace(old, new))
    _ALIVE.append(mutant)
    target = KERNEL_TARGETS[0]
    be = selection.get(target)
    a = paged(np.random.default_rng(2), B=1, Hq=4, Hkv=1, Sq=2, D=32, BS=8, MB=80,
              lens=[600])  # pages of 8: shorter than the CPU schedule's 16-key chunks
    if name in CASE_EDITS:
        a = CASE_EDITS[name](a)
    config = {**SPEC.schedules[be.device_class], **cfg}
    # into NaN: an output a mutant leaves unwritten must not pass with what a pooled buffer
    # held (a correct result of the same case, run before)
    b, hq, sq, _ = a["q"].shape
    out = pk.to_backend(np.full((b, hq, sq, a["v_cache"].shape[3]), np.nan, np.float32), target)
    got = pk.call(mutant, **a, backend=be, config=config, out=out).get()
    assert not compare_case(SPEC, Case(a, {}, "mutant"), got, be).ok, f"{name!r} survived"


def test_the_wrapper_declares_the_specs_defaults() -> None:
    from test_api_defaults import test_wrapper_defaults_are_the_specs

    test_wrapper_defaults_are_the_specs("paged_attention")


def test_the_decode_recipe_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/decode.md cannot rot: its Python blocks run, in order, in one namespace."""
    from pathlib import Path

    from test_tutorial import python_blocks

    doc = Path(__file__).resolve().parents[2] / "docs" / "decode.md"
    code = "\n\n".join(python_blocks(doc.read_text()))
    exec(compile(code, str(doc), "exec"), {"__name__": "decode_recipe"})  # noqa: S102
    out = capsys.readouterr().out
    assert "lengths: [5, 40, 100]" in out and "matches pk.attention per sequence" in out
    assert "block_table[1, 0] = 500 is outside [0, 64)" in out

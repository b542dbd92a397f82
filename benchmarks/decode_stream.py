"""How close paged decode comes to what this machine's memory gives a read-only stream.

Paged decode reads its K/V pages once and writes almost nothing, so its bound is the rate at
which the cores can *read*, which on a CPU is not the copy probe's figure: a copy (or an
in-place negation, jax's probe) counts a read and a write per element, and a core's reads are
bounded by its outstanding misses, its writes mostly not. This script times, interleaved call
by call in one process on one OpenCL device:

- ``decode``: ``pk.paged_attention`` on the quick suite's case (B, Hq 32, Hkv 8, D 128, fp16,
  pages of 16 tokens in a permuted pool), as users call it (the CPU schedule: a work-item
  per sequence and split takes each page for its 8 kv heads in turn, HEADS 8);
- ``decode, a head an item``: the same with HEADS 1, unsplit (a work-item per sequence and
  kv head, the schedule before HEADS);
- ``page stream``: a kernel that only reads the same pages in the same order as the decode
  (each page for a group's kv heads in turn, one work-item per sequence, group of heads and
  split, as the decode's plan on this device partitions them; the next head's page
  prefetched into L2 as the decode does), summing them so nothing is elided;
- ``page stream, a head an item``: the same, one work-item per sequence and kv head;
- ``flat read``: the same bytes read from one contiguous buffer (the best read rate);
- ``negate in place``: the jax probe's traffic (a read and a write per element, counted 2n).

Run: .venv/bin/python benchmarks/decode_stream.py [opencl:pocl] [B] [ctx] [rounds]
It prints each one's median time and rate, and the decode's rate as a share of each.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import portakern as pk
from portakern.ops import get_op
from portakern.ops import paged_attention as pa
from portakern.runtime import configs, selection

STREAM_SOURCE = r"""
__kernel void heads_stream(__global const ushort* K, __global const ushort* V,
                           __global const int* BT, __global uint* out, int mb, int hkv,
                           int row_elems, int nsplit, int heads) {
    const int g = get_global_id(0);
    const int ng = (hkv + heads - 1) / heads;
    const int s = g % nsplit, bg = g / nsplit, b = bg / ng;
    const int h0 = (bg - b * ng) * heads, h1 = min(hkv, h0 + heads);
    const int pps = (mb + nsplit - 1) / nsplit;
    const int plo = s * pps, phi = min(mb, plo + pps);
    uint16 a0 = 0, a1 = 0;
    for (int p = plo; p < phi; ++p) {
        for (int h = h0; h < h1; ++h) {  /* a block's heads sit side by side in the pool */
            const size_t page = ((size_t)BT[b * mb + p] * hkv + h) * row_elems;
            const int np = h + 1 < h1 ? p : p + 1, nh = h + 1 < h1 ? h + 1 : h0;
            if (np < phi) {
                const size_t nx = ((size_t)BT[b * mb + np] * hkv + nh) * row_elems;
                for (int i = 0; i < row_elems; i += 32) {
                    __builtin_prefetch(K + nx + i, 0, 1);
                    __builtin_prefetch(V + nx + i, 0, 1);
                }
            }
            for (int i = 0; i < row_elems; i += 32) {
                a0 += convert_uint16(vload16(0, K + page + i))
                      + convert_uint16(vload16(0, V + page + i));
                a1 += convert_uint16(vload16(0, K + page + i + 16))
                      + convert_uint16(vload16(0, V + page + i + 16));
            }
        }
    }
    vstore16(a0 + a1, g, out);
}
__kernel void flat_read(__global const float* X, __global float* out, int per) {
    const int g = get_global_id(0);
    const __global float* p = X + (size_t)g * per;
    float16 a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int i = 0; i < per; i += 64) {
        a0 += vload16(0, p + i); a1 += vload16(0, p + i + 16);
        a2 += vload16(0, p + i + 32); a3 += vload16(0, p + i + 48);
    }
    vstore16(a0 + a1 + a2 + a3, g, out);
}
__kernel void negate(__global float* X) {
    const int i = get_global_id(0);
    vstore8(-vload8(i, X), i, X);
}
"""


def main(argv: list[str]) -> None:
    import pyopencl as cl

    target = argv[1] if len(argv) > 1 else "opencl:pocl"
    batch = int(argv[2]) if len(argv) > 2 else 1
    ctx_len = int(argv[3]) if len(argv) > 3 else 32768
    rounds = int(argv[4]) if len(argv) > 4 else 20
    hq, hkv, d, bs = 32, 8, 128, 16
    mb = ctx_len // bs
    nb = mb * batch
    rng = np.random.default_rng(0)
    be: Any = selection.get(target)
    q = pk.to_backend(rng.standard_normal((batch, hq, 1, d), dtype=np.float32)
                      .astype(np.float16), target)
    pages = rng.standard_normal((nb, hkv, bs, d), dtype=np.float32).astype(np.float16)
    k = pk.to_backend(pages, target)
    v = pk.to_backend(pages, target)
    del pages
    table = rng.permutation(nb).reshape(batch, mb).astype(np.int32)
    lens = np.full((batch,), ctx_len, np.int32)
    nbytes = 2 * nb * hkv * bs * d * 2  # the K and V pages, read once
    flat = pk.to_backend(np.ones(nbytes // 4, np.float32), target)
    prg = cl.Program(be.ctx, STREAM_SOURCE).build()
    heads_k = cl.Kernel(prg, "heads_stream")
    # the decode's partition on this device: its groups of heads and splits, as planned
    spec = get_op("paged_attention")
    prob = spec.problem({"q": q, "k_cache": k, "v_cache": v, "block_table": table,
                         "seq_lens": lens}, dict(spec.params))
    cfg = configs.config_for(be, spec, prob)
    nsplit, heads = pa.splits(prob, cfg)[0], pa.heads_per_group(prob, cfg)
    groups = batch * -(-hkv // heads) * nsplit
    flat_k = cl.Kernel(prg, "flat_read")
    neg_k = cl.Kernel(prg, "negate")
    bt_dev = cl.Buffer(be.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                       hostbuf=table)
    out = cl.Buffer(be.ctx, cl.mem_flags.READ_WRITE, 64 * batch * hkv * 128 + 4096 * 64)
    items = 256

    def decode() -> None:
        pk.paged_attention(q, k, v, table, lens, backend=target).get()

    def decode_head() -> None:
        pk.paged_attention(q, k, v, table, lens, backend=target,
                           config={"HEADS": 1, "SPLIT": 1}).get()

    def heads_stream() -> None:
        heads_k(be.queue, (groups,), (1,), k.base_data, v.base_data, bt_dev, out,
                np.int32(mb), np.int32(hkv), np.int32(bs * d), np.int32(nsplit),
                np.int32(heads))
        be.queue.finish()

    def stream() -> None:  # one work-item per sequence and kv head, unsplit
        heads_k(be.queue, (batch * hkv,), (1,), k.base_data, v.base_data, bt_dev, out,
                np.int32(mb), np.int32(hkv), np.int32(bs * d), np.int32(1), np.int32(1))
        be.queue.finish()

    def flat_read() -> None:
        flat_k(be.queue, (items,), (1,), flat.base_data, out, np.int32(nbytes // 4 // items))
        be.queue.finish()

    def negate() -> None:
        neg_k(be.queue, (nbytes // 4 // 8,), (128,), flat.base_data)
        be.queue.finish()

    runs = {"decode": (decode, nbytes), "decode, a head an item": (decode_head, nbytes),
            "page stream": (heads_stream, nbytes), "page stream, a head an item": (stream, nbytes),
            "flat read": (flat_read, nbytes), "negate in place": (negate, 2 * nbytes)}
    for fn, _ in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        names = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in names:
            t0 = time.perf_counter()
            runs[name][0]()
            times[name].append(time.perf_counter() - t0)
    print(f"{target}: B{batch} x {ctx_len} tokens, {nbytes / 2**20:.0f} MiB of pages, "
          f"{rounds} interleaved rounds; the decode's plan: {heads} kv heads a group, "
          f"{nsplit} splits")
    dec = np.array(times["decode"])
    for name, (_, moved) in runs.items():
        t = np.array(times[name])
        share = np.median(t / dec) * nbytes / moved if name != "decode" else 1.0
        print(f"  {name:28s} {np.median(t) * 1e3:8.2f} ms  {moved / np.median(t) / 1e9:6.1f} GB/s"
              + ("" if name == "decode" else
                 f"   decode's rate = {100 * share:.0f}% of this (median of per-round ratios)"))


if __name__ == "__main__":
    main(sys.argv)

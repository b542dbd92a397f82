"""Helpers the op specs share: source loading, shape checks, geometry arithmetic."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from importlib import resources

from ..core.errors import ShapeError

MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y/z; OpenCL devices accept at least this


def kernel_source(*filenames: str) -> str:
    """Read .c files shipped beside the op modules (package data), joined in order: shared
    helpers (e.g. vexp.c) first, then the op's kernels."""
    root = resources.files("portakern.ops")
    return "\n".join(root.joinpath(f).read_text() for f in filenames)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= int(s)
    return strides[::-1]


def broadcast_strides(shape: Sequence[int], target: Sequence[int], inner: int) -> list[int]:
    """Element strides of a contiguous array of `shape` (batch dims, each block `inner` long)
    left-padded and broadcast to `target`: 0 along broadcast dims."""
    pad = [1] * (len(target) - len(shape)) + list(shape)
    base = contiguous_strides(pad)
    return [0 if p == 1 and t != 1 else st * inner for p, t, st in zip(pad, target, base)]


def collapse_dims(dims: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Merge adjacent dims whose strides are compatible for every operand (fewer, longer dims)."""
    out_d: list[int] = []
    out_s: list[list[int]] = [[] for _ in strides]
    for i, n in enumerate(dims):
        if n == 1:
            continue
        if out_d and all(s[-1] == st[i] * n for s, st in zip(out_s, strides)):
            out_d[-1] *= n
            for s, st in zip(out_s, strides):
                s[-1] = st[i]
            continue
        out_d.append(n)
        for s, st in zip(out_s, strides):
            s.append(st[i])
    return out_d, out_s


def batch_chunks(dims: list[int], strides: list[list[int]]
                 ) -> list[tuple[list[int], int, int, list[int], list[int]]]:
    """Cover the batch with launches of at most two in-kernel dims and MAX_GRID_YZ groups.

    Returns (offsets per operand, n0, n1, strides dim0 per operand, strides dim1 per operand).
    """
    nops = len(strides)
    d = list(dims)
    s = [list(x) for x in strides]
    while len(d) < 2:
        d.insert(0, 1)
        for x in s:
            x.insert(0, 0)
    outer, (n0, n1) = d[:-2], d[-2:]
    s_outer = [x[:-2] for x in s]
    s0 = [x[-2] for x in s]
    s1 = [x[-1] for x in s]
    c1 = min(n1, MAX_GRID_YZ)
    c0 = max(1, min(n0, MAX_GRID_YZ // c1))
    chunks = []
    for idx in itertools.product(*[range(n) for n in outer]):
        base = [sum(i * st for i, st in zip(idx, s_outer[o])) for o in range(nops)]
        for i0 in range(0, n0, c0):
            for i1 in range(0, n1, c1):
                off = [base[o] + i0 * s0[o] + i1 * s1[o] for o in range(nops)]
                chunks.append((off, min(c0, n0 - i0), min(c1, n1 - i1), s0, s1))
    return chunks


def need_rank(spec: str, name: str, shape: Sequence[int], rank: int | None = None,
              min_rank: int | None = None, layout: str = "") -> None:
    if rank is not None and len(shape) != rank:
        raise ShapeError(f"{spec}: {name} must have rank {rank} {layout}; got shape "
                         f"{tuple(shape)} (rank {len(shape)}).")
    if min_rank is not None and len(shape) < min_rank:
        raise ShapeError(f"{spec}: {name} must have rank >= {min_rank} {layout}; got shape "
                         f"{tuple(shape)} (rank {len(shape)}). Add leading axes, e.g. x[None].")

"""Concurrency: every op from 8 threads at once on every backend target, and backend selection
that stays where it was set (per thread, per asyncio task).

What is checked, and why:

* correct results under contention — each thread has its own shapes, dtypes and values, so a
  result computed from another thread's buffers, or an argument set on a shared kernel object
  by another thread between set_args and enqueue, fails the oracle check (cases.compare under
  the op's tolerance). Device targets mix numpy and native inputs.
* a cold start raced by 8 threads: a fresh backend instance (empty caches) compiles each
  kernel exactly once and caches one entry, however many threads ask for it at once.
* ``pk.use`` is a contextvar: a thread's or an asyncio task's choice is invisible to the
  others, nested blocks restore the outer choice, and a new thread starts with no choice
  (pass ``contextvars.copy_context().run`` to hand one over).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import portakern as pk
from portakern.backend.base import Backend, KernelBackend
from portakern.core import dtypes
from portakern.core.sampling import Case
from portakern.ops import get_op
from portakern.runtime import selection
from portakern.tools.cases import compare

from conftest import TARGETS

THREADS = 8
CALLS_PER_THREAD = 3
TIMEOUT_S = 120.0

# per thread i: shape set i % 4, dtype float32 except threads 6 (float16) and 7 (bfloat16)
SHAPES = {
    "matmul": [((2, 9, 7), (7, 5)), ((17, 33), (33, 3)), ((3, 1, 16, 8), (2, 8, 9)),
               ((65, 64), (64, 31))],
    "softmax": [((5, 17), -1), ((3, 40, 2), 1), ((257,), 0), ((16, 64), 0)],
    "attention": [((1, 2, 9, 16), (1, 1, 12, 16), False), ((2, 2, 5, 8), (2, 2, 5, 8), True),
                  ((1, 4, 17, 40), (1, 2, 17, 40), True), ((1, 1, 33, 16), (1, 1, 20, 16), False)],
}


def _dtype(i: int) -> str:
    return {6: "float16", 7: "bfloat16"}.get(i, "float32")


def make_case(op: str, i: int, rep: int) -> Case:
    """Thread i's rep-th call: its own shape family, dtype and values (seeded by i and rep)."""
    rng = np.random.default_rng(1000 * i + rep)
    dt = _dtype(i)
    spec = SHAPES[op][i % len(SHAPES[op])]

    def arr(shape: tuple[int, ...], offset: float = 0.0) -> np.ndarray:
        return dtypes.cast_to(rng.standard_normal(shape) + offset, dt)

    if op == "matmul":
        (sa, sb) = spec  # type: ignore[misc]
        return Case({"a": arr(sa), "b": arr(sb)})
    if op == "softmax":
        shape, axis = spec  # type: ignore[misc]
        return Case({"x": arr(shape, offset=100.0 * i)}, {"axis": axis})
    sq, sk, causal = spec  # type: ignore[misc]
    q, k = arr(sq), arr(sk)
    mask = rng.random((sq[2], sk[2])) < 0.8 if rep % 2 else None
    return Case({"q": q, "k": k, "v": arr(sk), "mask": mask},
                {"causal": causal, "scale": None})


def _run(be: Backend, op: str, case: Case, native: bool) -> np.ndarray:
    arrays = {k: (be.to_native(v) if native and v is not None else v)
              for k, v in case.arrays.items()}
    got = pk.call(op, **arrays, **case.params, backend=be)
    return be.to_numpy(got) if native else got


def _all_at_once(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0..n-1) in n threads released together by a barrier; re-raise any failure."""
    barrier = threading.Barrier(n, timeout=TIMEOUT_S)

    def worker(i: int) -> Any:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(worker, i) for i in range(n)]
        return [f.result(timeout=TIMEOUT_S) for f in futures]


@pytest.mark.parametrize("op", sorted(SHAPES))
def test_each_op_from_8_threads_at_once(target: str, op: str) -> None:
    be = selection.get(target)
    spec = get_op(op)
    on_device = not isinstance(be.to_native(np.zeros(1, np.float32)), np.ndarray)

    def thread(i: int) -> list[str]:
        problems = []
        for rep in range(CALLS_PER_THREAD):
            case = make_case(op, i, rep)
            if _dtype(i) not in be.supported_dtypes():
                continue
            got = _run(be, op, case, native=on_device and (i + rep) % 2 == 1)
            verdict = compare(spec, case, got)
            if not verdict.ok:
                problems.append(f"thread {i} call {rep} ({case.describe()}): {verdict.where} "
                                f"(error/bound {verdict.worst_ratio:.3g})")
        return problems

    problems = [p for got in _all_at_once(THREADS, thread) for p in got]
    assert not problems, f"{op} on {target} from {THREADS} threads:\n" + "\n".join(problems)


def _fresh(target: str) -> Backend:
    """A new instance of the target's backend: empty kernel, plan and function caches."""
    be = selection.get(target)
    return type(be)(be.selector)


@pytest.mark.parametrize("op", sorted(SHAPES))
def test_cold_start_raced_by_8_threads_compiles_once(target: str, op: str) -> None:
    be = _fresh(target)
    compiles: list[int] = []
    if isinstance(be, KernelBackend):
        real = be.compile

        def counting(source: str, entry_points: tuple[str, ...]) -> Any:
            compiles.append(1)
            return real(source, entry_points)

        be.compile = counting  # type: ignore[method-assign]
    case = make_case(op, 1, 0)  # one shape, one dtype: every thread needs the same kernel

    results = _all_at_once(THREADS, lambda i: _run(be, op, case, native=False))
    for got in results:
        verdict = compare(get_op(op), case, got)
        assert verdict.ok, f"{op} cold on {target}: {verdict.where}"
    caches = be.cache_info()
    if isinstance(be, KernelBackend):
        kernels = caches["kernels"]
        assert len(compiles) == kernels["size"] == kernels["inserts"], \
            f"{len(compiles)} compiles for the cached kernel sets: {kernels}"
        assert kernels["size"] == 1, f"expected one cached kernel set: {kernels}"
    if "functions" in caches:
        fns = caches["functions"]
        assert fns["size"] == fns["inserts"] == 1, f"expected one jitted function: {fns}"


# --- selection is per thread and per task ---------------------------------------------------
def _label(be: Backend) -> str:
    return be.label


def test_use_in_one_thread_does_not_leak_into_another() -> None:
    """8 threads, each inside ``with pk.use(target_i)`` at the same time (targets cycle),
    plus the main thread outside any block."""
    before = selection.current_choice()
    gate = threading.Barrier(THREADS, timeout=TIMEOUT_S)

    def thread(i: int) -> tuple[str, str, str | None]:
        want = selection.get(TARGETS[i % len(TARGETS)])
        assert selection.current_choice() is None, "a new thread inherited a use() choice"
        with pk.use(want):
            gate.wait()  # every thread is inside its own block now
            seen = _label(selection.resolve())
            with pk.use("numpy"):  # nested: inner wins, outer restored afterwards
                inner = _label(selection.resolve())
            gate.wait()
            again = _label(selection.resolve())
            assert again == seen
            a = np.full((3, 4), float(i), np.float32)
            np.testing.assert_allclose(pk.softmax(a), np.full((3, 4), 0.25), rtol=1e-3)
            text = pk.explain()
        gate.wait()
        after = selection.current_choice()
        assert want.describe() in text and "portakern.use" in text, text
        return seen, inner, None if after is None else str(after)

    got = _all_at_once(THREADS, thread)
    for i, (seen, inner, after) in enumerate(got):
        assert seen == selection.get(TARGETS[i % len(TARGETS)]).label
        assert inner == selection.get("numpy").label
        assert after is None
    assert selection.current_choice() is before


def test_a_new_thread_starts_without_the_parents_choice_unless_handed_over() -> None:
    other = next((t for t in TARGETS if not t.startswith("numpy")), "numpy")
    seen: dict[str, Any] = {}
    with pk.use(other) as chosen:
        t = threading.Thread(target=lambda: seen.update(plain=selection.current_choice()))
        t.start()
        t.join()
        ctx = contextvars.copy_context()
        t = threading.Thread(target=lambda: ctx.run(
            lambda: seen.update(handed=selection.resolve())))
        t.start()
        t.join()
    assert seen["plain"] is None
    assert seen["handed"] is chosen


def test_use_is_per_asyncio_task() -> None:
    async def task(i: int, started: asyncio.Event, ready: list[int]) -> tuple[str, str]:
        want = selection.get(TARGETS[i % len(TARGETS)])
        with pk.use(want):
            ready.append(i)
            if len(ready) == THREADS:
                started.set()
            await started.wait()  # all tasks are inside their blocks, interleaved
            await asyncio.sleep(0)
            seen = _label(selection.resolve())
            out = pk.matmul(np.eye(3, dtype=np.float32), np.ones((3, 2), np.float32))
            np.testing.assert_allclose(out, np.ones((3, 2)))
            await asyncio.sleep(0)
            return seen, _label(selection.resolve())

    async def main() -> tuple[list[tuple[str, str]], object]:
        started, ready = asyncio.Event(), []  # type: ignore[var-annotated]
        with pk.use("numpy"):  # tasks created here inherit it, and their own use() stays put
            inherited = await asyncio.create_task(_current_in_task())
            res = await asyncio.gather(*(task(i, started, ready) for i in range(THREADS)))
        return list(res), inherited

    async def _current_in_task() -> object:
        return selection.resolve()

    before = selection.current_choice()
    results, inherited = asyncio.run(main())
    assert inherited is selection.get("numpy")
    for i, (seen, later) in enumerate(results):
        want = selection.get(TARGETS[i % len(TARGETS)]).label
        assert seen == want and later == want, (i, seen, later, want)
    assert selection.current_choice() is before

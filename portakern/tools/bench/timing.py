"""Timing: warm-up, device-synchronised samples, repetition to a minimum measured time.

Why this shape: these machines are noisy and our kernels range from microseconds to seconds.
A fixed repetition count either wastes minutes on a slow case or gives a meaningless median on
a fast one, so every measurement repeats until it has both ``min_reps`` samples and
``min_time`` seconds of measured time, never more than ``max_reps`` samples, and stops early
when the next sample would overrun its ``budget_s`` (time-boxing: the slowest case of a suite
must not eat the suite). The first call is timed on its own and never mixed into the samples,
because it contains compilation (or a cache load, or an XLA trace) that is reported separately.

Each sample is ``fn(); sync()`` between two clock reads: ``sync`` is the backend's
``synchronize()`` (or ``block_until_ready``), so asynchronous launches are charged to the
sample that issued them and not to the next one.

**Interleaved rounds** (``prepare`` and ``run_rounds``): a case's implementations (ours, the
unfused chain, every peer) are each prepared first (first call and warm-up, as above), then
sampled once per round, one after the other, the order rotated each round, until the
implementations together have ``min_reps`` rounds and ``min_time`` seconds of
samples *each on average*, never more than ``max_reps`` rounds, within ``budget_s`` per
implementation. Why: on a shared machine a burst of load that lands while one side is sampled
would change a ratio of two medians taken one after the other; in rounds it lands on both
sides of the round it hits, and the median of the per-round ratios ignores it. An
implementation whose calls are short (``rewarm_below_s``) is first called untimed for at
least ``rewarm_s`` (at least once) right before each of its timed calls, so its thread pool
and caches are as warm as in back-to-back samples: each sample is still exactly one
synchronised call that followed calls of its own. Why a time, not one call: on a 2-core
machine every implementation's threads (PoCL's and Intel's workers, torch's OpenMP pool) spin
a while after a call and sleep after that; one untimed call right after another pool's was
measured to leave both sides up to ~2.5x slower than back to back (rmsnorm 64x4096 on a quiet
machine: ours 176-179 us and torch 184-234 us interleaved call by call, against 72-135 and
104-165 back to back), and only ~10 ms of calls of its own brought Intel's runtime back to
its back-to-back time.

**Settling** (``settle``): before each sample in interleaved rounds, the rounds wait until no
other thread of the benchmark's processes (this one and its children, the peers' worker) is
running, at most ``settle_max_s``. A library's helper threads keep spinning after its call
returns, on a core the next implementation needs: OpenBLAS's, after the numpy peer's sample,
spin ~0.1 s in the worker process that also runs torch, and torch's SDPA sampled then ran
1.6x slower than alone (attention S=4096 causal: torch 108-110 ms in rounds, 62-66 ms alone;
B1 H8 S512: 6.3-7.9 ms against 2.2 ms), which overstated every ratio to torch. Rewarming
cannot help there (torch's own calls compete with the spinning thread as much). The wait is
read from /proc (each thread's state: R running) and costs one scan when nothing spins.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

Clock = Callable[[], float]


@dataclass(frozen=True)
class TimingConfig:
    """How long and how often to measure one implementation of one case."""

    min_time: float = 0.2  # seconds of measured (sampled) time to collect at least
    min_reps: int = 3  # samples to collect at least (the budget may cut this short)
    max_reps: int = 200  # never more samples than this
    budget_s: float = 25.0  # wall-clock box for first call + warm-up + samples
    warmup_reps: int = 1  # untimed calls after the first one, when cheap (see below)
    warmup_below_s: float = 1.0  # extra warm-up only if the first call took less than this
    # in interleaved rounds, a call shorter than this is preceded by untimed calls of its own
    # for at least rewarm_s (thread pools asleep or still spinning for another
    # implementation, and caches cold, would otherwise be charged to it; a longer call does
    # not notice)
    rewarm_below_s: float = 0.05
    rewarm_s: float = 0.01
    # before each sample in rounds, wait up to this long for every other thread of the
    # benchmark's processes to stop running (settle; 0: never wait)
    settle_max_s: float = 0.5

    def __post_init__(self) -> None:
        problems = []
        if not self.min_time >= 0:
            problems.append(f"min_time={self.min_time!r} (expected >= 0)")
        if self.min_reps < 1:
            problems.append(f"min_reps={self.min_reps!r} (expected >= 1)")
        if self.max_reps < self.min_reps:
            problems.append(f"max_reps={self.max_reps!r} (expected >= min_reps={self.min_reps})")
        if not self.budget_s > 0:
            problems.append(f"budget_s={self.budget_s!r} (expected > 0)")
        if self.warmup_reps < 0:
            problems.append(f"warmup_reps={self.warmup_reps!r} (expected >= 0)")
        if not self.rewarm_below_s >= 0:
            problems.append(f"rewarm_below_s={self.rewarm_below_s!r} (expected >= 0)")
        if not self.rewarm_s >= 0:
            problems.append(f"rewarm_s={self.rewarm_s!r} (expected >= 0)")
        if not self.settle_max_s >= 0:
            problems.append(f"settle_max_s={self.settle_max_s!r} (expected >= 0)")
        if problems:
            raise ValueError("invalid TimingConfig: " + ", ".join(problems)
                             + ". Fix the --min-time/--budget options or the suite table.")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Stats:
    """Order statistics of a list of samples (seconds)."""

    n: int
    median: float
    q1: float
    q3: float
    min: float
    max: float
    total: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default method) of already-sorted data."""
    if not sorted_xs:
        raise ValueError("quantile of an empty sample list; expected at least one sample.")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q!r} is outside [0, 1].")
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    frac = pos - lo
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * frac)


def summarize(samples: Sequence[float]) -> Stats:
    """Median, quartiles, extremes and sum of a non-empty list of sample times."""
    if not samples:
        raise ValueError("summarize() needs at least one sample; got none. A measurement that "
                         "collected nothing must be recorded as an error, not summarised.")
    xs = sorted(float(x) for x in samples)
    return Stats(n=len(xs), median=quantile(xs, 0.5), q1=quantile(xs, 0.25),
                 q3=quantile(xs, 0.75), min=xs[0], max=xs[-1], total=float(sum(xs)))


@dataclass
class Measurement:
    """One implementation of one case on one device: what happened and how long it took."""

    status: str = "ok"  # ok | error | unsupported | unavailable | interrupted | skipped
    what: str = ""  # exactly what was timed, in words
    first_call_s: float | None = None
    samples: list[float] = field(default_factory=list)
    stopped_by: str = ""  # min_time | max_reps | budget
    reason: str = ""  # why not ok
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def stats(self) -> Stats | None:
        return summarize(self.samples) if self.samples else None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.samples)

    @property
    def median(self) -> float | None:
        st = self.stats
        return st.median if st else None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status, "what": self.what}
        if self.reason:
            d["reason"] = self.reason
        st = self.stats
        if st is not None:
            d.update(median_s=st.median, q1_s=st.q1, q3_s=st.q3, min_s=st.min, max_s=st.max,
                     reps=st.n, measured_s=st.total, stopped_by=self.stopped_by,
                     samples_s=list(self.samples))
        if self.first_call_s is not None:
            d["first_call_s"] = self.first_call_s
            if st is not None:
                # what the first call cost beyond a warm one: compile, trace or cache load
                d["first_call_overhead_s"] = max(0.0, self.first_call_s - st.median)
        if self.info:
            d["info"] = self.info
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        return cls(status=d.get("status", "ok"), what=d.get("what", ""),
                   first_call_s=d.get("first_call_s"), samples=list(d.get("samples_s") or []),
                   stopped_by=d.get("stopped_by", ""), reason=d.get("reason", ""),
                   info=dict(d.get("info") or {}))


def not_run(status: str, reason: str, what: str = "") -> Measurement:
    """A measurement that never ran: unsupported dtype, peer unavailable, error, ..."""
    return Measurement(status=status, what=what, reason=reason)


class Sampler:
    """One implementation of a case ready to be sampled: its ``m`` (first call, what, info;
    the samples as they come) and ``sample()``, one more timed, synchronised call. ``close``
    lets go of what it holds (inputs, a peer process's prepared state)."""

    m: Measurement
    begin: float | None = None  # clock() before its first call, where known

    def sample(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        return None


class Prepared(Sampler):
    """``fn`` (with ``sync`` after every call) after its first call and warm-up, in this
    process. ``scope`` (a context manager factory, e.g. ``np.errstate``) is entered around the
    first call, the warm-up and each sample, outside the timed region."""

    def __init__(self, m: Measurement, fn: Callable[[], object], sync: Callable[[], object],
                 cfg: TimingConfig, clock: Clock, begin: float, typical: float, rewarm: bool,
                 scope: Callable[[], AbstractContextManager[Any]] | None) -> None:
        self.m, self.fn, self.sync, self.cfg, self.clock = m, fn, sync, cfg, clock
        self.begin = self.started = begin  # clock() before the first call: its time box
        self.typical = typical  # the latest call's time (a warm-up call's, then a sample's)
        self.rewarm = rewarm
        self.scope = scope or contextlib.nullcontext
        self.rewarms = 0

    def sample(self) -> float:
        fn, sync, clock = self.fn, self.sync, self.clock
        with self.scope():
            if self.rewarm and self.typical < self.cfg.rewarm_below_s:
                until = clock() + self.cfg.rewarm_s
                while True:  # untimed: this call's own state, as back-to-back samples have it
                    fn()
                    sync()
                    self.rewarms += 1
                    if clock() >= until:
                        break
            t = clock()
            fn()
            sync()
            dt = clock() - t
        self.m.samples.append(dt)
        self.typical = dt
        return dt

    def close(self) -> None:
        """Let go of ``fn`` (and what it holds); record the untimed calls made before samples.
        Safe to call twice."""
        if self.rewarms:
            self.m.info["untimed_calls_before_samples"] = self.rewarms
        self.fn = self.sync = _nothing


def _nothing() -> None:
    return None


def prepare(fn: Callable[[], object], sync: Callable[[], object], cfg: TimingConfig, *,
            what: str = "", clock: Clock = time.perf_counter, rewarm: bool = True,
            scope: Callable[[], AbstractContextManager[Any]] | None = None) -> Prepared:
    """Time the first call of ``fn`` on its own, warm it up (module docstring) and return it
    ready for ``run_rounds``. Exceptions propagate; a KeyboardInterrupt during the warm-up
    carries the measurement (``exc.partial``, status ``interrupted``)."""
    ctx = scope or contextlib.nullcontext
    begin = clock()
    with ctx():
        t0 = clock()
        fn()
        sync()
        first = clock() - t0
        m = Measurement(what=what, first_call_s=first)
        typical = first
        try:
            if first < cfg.warmup_below_s:
                for _ in range(cfg.warmup_reps):
                    t0 = clock()
                    fn()
                    sync()
                    typical = clock() - t0
        except KeyboardInterrupt as exc:
            m.status, m.stopped_by = "interrupted", "interrupted"
            exc.partial = m  # type: ignore[attr-defined]  # documented above: rides on the interrupt
            raise
    return Prepared(m, fn, sync, cfg, clock, begin, typical, rewarm, scope)


def _running_threads(pid: int, skip: int | None) -> int:
    """How many threads of process ``pid`` are running now (state R in /proc), ``skip`` (a
    thread id) left out; -1 where /proc cannot tell."""
    import os

    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return -1
    n = 0
    for tid in tids:
        if skip is not None and int(tid) == skip:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        # the state follows the command name, which is in parentheses and may hold spaces
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
        n += state == b"R"
    return n


# children that settle() does not wait for: a load started on purpose (bench --hog's busy
# loop, hog.Hog adds and removes its pid), which never stops running
SETTLE_IGNORED: set[int] = set()


def _tree() -> list[int]:
    """This process and its children (the peers' worker processes), SETTLE_IGNORED left out."""
    import os

    pids = [os.getpid()]
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return [p for p in pids if p not in SETTLE_IGNORED]


def settle(max_s: float, clock: Clock = time.perf_counter, poll_s: float = 0.0005) -> float:
    """Wait until no thread of this process tree but the caller is running, at most
    ``max_s``; return the seconds waited (module docstring: why). Where /proc is missing it
    returns at once."""
    import threading

    if max_s <= 0:
        return 0.0
    me = threading.get_native_id()
    start = clock()
    pids = _tree()
    while True:
        counts = [_running_threads(pid, me) for pid in pids]
        if all(c <= 0 for c in counts):
            return clock() - start
        if clock() - start >= max_s:
            return clock() - start
        time.sleep(poll_s)


def run_rounds(impls: Mapping[str, Sampler], cfg: TimingConfig, *, begin: float,
               budget_s: float | None = None, anchor: str | None = None,
               clock: Clock = time.perf_counter) -> int:
    """Sample every implementation once per round, the order rotated each round (module
    docstring); return the number of rounds. ``budget_s`` (default ``cfg.budget_s`` per
    implementation) boxes everything since ``begin``; the next round is skipped when it would
    overrun the box, but the first always runs. An implementation whose sample raises is
    marked ``error`` and left out of later rounds; if it is ``anchor`` (ours: every ratio is
    to it) the rounds end there. On Ctrl-C every measurement keeps its samples
    (``stopped_by: interrupted``) and the interrupt carries them as ``exc.partial``, a dict
    like ``impls``."""
    keys = list(impls)
    box = cfg.budget_s * len(keys) if budget_s is None else budget_s
    active = dict(impls)
    n, stop = 0, "min_time"
    try:
        while active:
            if n:
                if n >= cfg.max_reps:
                    stop = "max_reps"
                    break
                measured = sum(sum(p.m.samples) for p in impls.values())
                if n >= cfg.min_reps and measured >= cfg.min_time * len(keys):
                    stop = "min_time"
                    break
                expected = sum(summarize(p.m.samples).median for p in active.values()
                               if p.m.samples)
                if clock() - begin + expected > box:
                    stop = "budget"
                    break
            k = n % len(keys)
            for key in keys[k:] + keys[:k]:
                p = active.get(key)
                if p is None:
                    continue
                if len(keys) > 1:  # another implementation's threads may still spin
                    waited = settle(cfg.settle_max_s)
                    p.m.info["settled_s"] = p.m.info.get("settled_s", 0.0) + waited
                try:
                    p.sample()
                except KeyboardInterrupt:
                    raise
                except Exception as exc:
                    p.m.status = "error"
                    p.m.reason = (f"failed in round {n + 1}: {type(exc).__name__}: "
                                  f"{str(exc)[:700]}")
                    del active[key]
                    if key == anchor:
                        active.clear()
                        stop = f"{anchor} failed"
                        break
            n += 1
    except KeyboardInterrupt as exc:
        for p in impls.values():
            p.m.stopped_by = "interrupted"
            if not p.m.samples and p.m.status == "ok":
                p.m.status = "interrupted"
        exc.partial = dict(impls)  # type: ignore[attr-defined]  # documented above
        raise
    for p in impls.values():
        p.m.stopped_by = p.m.stopped_by or stop
        p.m.info["rounds"] = len(p.m.samples)
    return n


def measure(fn: Callable[[], object], sync: Callable[[], object], cfg: TimingConfig, *,
            what: str = "", clock: Clock = time.perf_counter) -> Measurement:
    """Time ``fn`` (with ``sync`` after every call) under ``cfg`` on its own: ``prepare``,
    then rounds of one implementation (back-to-back samples, so no untimed call between
    them). Exceptions from ``fn`` propagate (the caller records them with their message),
    except that samples collected before a KeyboardInterrupt are kept: the interrupt is
    re-raised with the partial measurement attached as ``exc.partial``.
    """
    p = prepare(fn, sync, cfg, what=what, clock=clock, rewarm=False)
    try:
        run_rounds({"_": p}, cfg, begin=p.started, budget_s=cfg.budget_s, clock=clock)
    except KeyboardInterrupt as exc:
        p.m.status = "interrupted" if not p.m.samples else "ok"
        exc.partial = p.m  # type: ignore[attr-defined]  # documented above: rides on the interrupt
        raise
    finally:
        p.close()
    p.m.info.pop("rounds", None)
    return p.m

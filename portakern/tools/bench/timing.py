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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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


def measure(fn: Callable[[], object], sync: Callable[[], object], cfg: TimingConfig, *,
            what: str = "", clock: Clock = time.perf_counter) -> Measurement:
    """Time ``fn`` (with ``sync`` after every call) under ``cfg``; see the module docstring.

    Exceptions from ``fn`` propagate (the caller records them with their message), except
    that samples collected before a KeyboardInterrupt are kept: the interrupt is re-raised
    with the partial measurement attached as ``exc.partial``.
    """
    begin = clock()
    t0 = clock()
    fn()
    sync()
    first = clock() - t0
    m = Measurement(what=what, first_call_s=first)
    try:
        if first < cfg.warmup_below_s:
            for _ in range(cfg.warmup_reps):
                fn()
                sync()
        while True:
            n = len(m.samples)
            if n:
                if n >= cfg.max_reps:
                    m.stopped_by = "max_reps"
                    break
                if n >= cfg.min_reps and sum(m.samples) >= cfg.min_time:
                    m.stopped_by = "min_time"
                    break
                expected = summarize(m.samples).median
                if clock() - begin + expected > cfg.budget_s:
                    m.stopped_by = "budget"
                    break
            t = clock()
            fn()
            sync()
            m.samples.append(clock() - t)
    except KeyboardInterrupt as exc:
        m.status = "interrupted" if not m.samples else "ok"
        m.stopped_by = "interrupted"
        exc.partial = m  # type: ignore[attr-defined]  # documented above: rides on the interrupt
        raise
    return m

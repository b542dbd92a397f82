"""The persistent autotuner: ``portakern tune OP --backend B`` and the lookup ops use.

What it does and why:

* **Search** over the spec's declared tunables (finite domains): the default schedules first
  (so a result can never be slower than what ships, and the speedup is measured against it),
  then random samples of the domain product mixed with greedy moves (one tunable to its
  neighbouring domain value) around the best so far. Configurations that ``spec.config``
  rejects, whose work-groups exceed the device's limit, or whose compiled kernel needs more
  local memory or a smaller work-group than the driver reports, are skipped before timing.
* **Correctness first**: every candidate's output is checked against the float64 oracle under
  the op's tolerance (``cases.compare``) on the measured problem (when its oracle is cheap,
  ``ORACLE_FLOPS_LIMIT``) and on random edge-case problems from ``cases.CASES``; one failure
  rejects it. A fast wrong kernel is never stored.
* **Timing** like the benchmark: compile and first call excluded, one warm-up, device
  synchronisation around every sample, median of repeats (at least ``MIN_REPS`` and
  ``MIN_TIME`` seconds); a candidate already clearly slower than the best is cut short.
* **Storage**: the winner goes to the per-device database (``cache.Store`` under
  ``tuning/<device key>``). The device key hashes the backend name, vendor, device name,
  driver, platform and the backend's runtime/compiler versions (``Availability.versions``);
  each entry is keyed by op, problem bucket and the kernel source hash
  (``codegen.source_hash(spec.source)``), so a changed kernel or driver never reuses numbers
  measured for another.
* **Problem bucket** = dtype + a size class of every integer the spec derives for a problem
  (matmul: M, N, K; softmax: outer, n, inner; attention: B, Hq, Hkv, Sq, Sk, D, Dv). The
  class of a size v is ceil(log4 v): 1 | 2-4 | 5-16 | 17-64 | 65-256 | 257-1024 | ... Factor-4
  classes keep shapes that want the same schedule together (a 300^3 and a 500^3 matmul) while
  separating the ones that do not (GEMV M=1 vs a square matmul). A call whose bucket was not
  tuned uses the *nearest* tuned bucket of the same dtype on that device (smallest summed class
  distance), because any valid configuration is correct for every shape — the tests check
  exactly that — and a nearby tuning beats the generic default; ``PORTAKERN_TUNING=exact``
  restricts lookups to the exact bucket and ``PORTAKERN_TUNING=0`` disables them.
* **Nothing read from disk is trusted**: an entry is schema-checked, its source hash must match
  the current kernel (stale entries are ignored), and its configuration goes through
  ``spec.config`` — the tunables' domains and the spec's own check — before it can reach
  kernel source or compiler options. A rejected entry warns (``TuningWarning``) and the
  default schedule is used.
* **Hot path**: ``lookup`` runs only when a backend's per-(spec, bucket) config cache misses;
  a device's entries are read from disk once per process (``_INDEX``). ``cache_token`` is
  what that backend cache is keyed on: the bucket plus a generation number that saving or
  clearing entries in this process bumps, so a fresh tuning takes effect immediately.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core import codegen, dtypes, settings
from ..core.cache import Store
from ..core.errors import InvalidArgumentError, PortakernError, SpecError
from ..core.spec import KernelSpec, Problem
from ..runtime.configs import (
    _DEVKEY_RE,
    ENV_TUNING,
    NAMESPACE,
    SCHEMA,
    Bucket,
    Entry,
    bucket,
    bucket_key,
    bucket_label,
    device_entries,
    device_key,
    fingerprint,
    format_entry,
    invalidate,
    mode,
    parse_entry,
    store_for,
    summarize,
)

if TYPE_CHECKING:
    from ..backend.base import Backend, KernelBackend

ORACLE_FLOPS_LIMIT = 1e9  # check the measured problem itself when its float64 oracle is cheap
MIN_REPS = 5
MIN_TIME = 0.05
MAX_REPS = 200
PRUNE_FACTOR = 1.5  # stop timing a candidate whose median is this much slower than the best
CONFIRM_SHARE = 0.15  # of the budget, kept to re-time the finalists against the default
CONFIRM_TOP = 3


# --- storing ------------------------------------------------------------------------------
def make_entry(fp: Mapping[str, Any], spec: KernelSpec, prob: Problem, config: Mapping[str, int],
               **meta: Any) -> dict[str, Any]:
    """The JSON record of a tuning result (``meta``: time_s, default_time_s, budget_s, ...)."""
    from .._version import __version__

    b = bucket(prob)
    return {"schema": SCHEMA, "op": spec.name, "source_hash": codegen.source_hash(spec.source),
            "bucket": bucket_key(b), "dtype": b[0], "classes": dict(b[1]),
            "config": {k: int(v) for k, v in config.items()}, "device_key": device_key(fp),
            "device": dict(fp),
            "shapes": {k: (list(v) if v is not None else None) for k, v in prob.shapes.items()},
            "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "portakern": __version__, **meta}


def save_entry(payload: Mapping[str, Any]) -> Path | None:
    """Validate and store a record; return its file (None if the cache could not save it)."""
    got = parse_entry(dict(payload))
    if isinstance(got, str):
        raise InvalidArgumentError(f"refusing to store a malformed tuning entry: {got}; "
                                   "expected a record built by tune.make_entry().")
    st = store_for(got.device_key)
    ok = st.put(got.key, dict(payload))
    invalidate()
    return st.filename(got.key) if ok else None



# --- measuring ----------------------------------------------------------------------------
@dataclass
class Outcome:
    """One measured candidate: status 'ok' | 'slower' (cut short) | 'rejected' | 'failed'."""

    config: dict[str, int]
    origin: str
    status: str
    median_s: float | None = None
    samples: int = 0
    note: str = ""


@dataclass
class TuneResult:
    op: str
    backend: str
    bucket: Bucket
    best: Outcome | None
    default: Outcome | None
    outcomes: list[Outcome]
    skipped: Counter[str]
    stored: Path | None
    elapsed_s: float

    @property
    def speedup(self) -> float | None:
        if self.best and self.default and self.best.median_s and self.default.median_s:
            return self.default.median_s / self.best.median_s
        return None


def time_call(fn: Callable[[], Any], sync: Callable[[], None], *, deadline: float | None = None,
              cutoff: float | None = None, min_reps: int = MIN_REPS, min_time: float = MIN_TIME,
              max_reps: int = MAX_REPS) -> tuple[float, int, bool]:
    """(median seconds, samples, complete): one warm-up, then device-synchronised samples until
    min_reps and min_time are both met; cut short past ``deadline`` or when the median exceeds
    ``cutoff`` (complete=False: the median is then only an indication)."""
    fn()
    sync()
    samples: list[float] = []
    while len(samples) < max_reps:
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= min_reps and sum(samples) >= min_time:
            return statistics.median(samples), len(samples), True
        if cutoff is not None and len(samples) >= 2 and statistics.median(samples) > cutoff:
            return statistics.median(samples), len(samples), False
        if deadline is not None and time.monotonic() >= deadline:
            return statistics.median(samples), len(samples), False
    return statistics.median(samples), len(samples), True


def random_inputs(spec: KernelSpec, prob: Problem, rng: np.random.Generator
                  ) -> dict[str, np.ndarray | None]:
    """Host arrays for a problem: standard normal floats in the storage dtype, 70% True masks."""
    out: dict[str, np.ndarray | None] = {}
    for o in spec.operands:
        shape = prob.shapes.get(o.name)
        if shape is None:
            out[o.name] = None
        elif o.kind == "bool":
            out[o.name] = rng.random(shape) < 0.7
        elif o.kind == "acc":  # e.g. a log-sum-exp: in the compute type
            out[o.name] = dtypes.cast_to(rng.standard_normal(shape),
                                         dtypes.compute_dtype_name(prob.dtype))
        else:
            out[o.name] = dtypes.cast_to(rng.standard_normal(shape), prob.dtype)
    return out


def _fmt_cfg(cfg: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _fmt_t(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.3f} s"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


class _Search:
    """Candidate generation: defaults, then random samples and greedy neighbour moves."""

    def __init__(self, spec: KernelSpec, be: KernelBackend, prob: Problem,
                 rng: np.random.Generator) -> None:
        self.spec, self.be, self.prob, self.rng = spec, be, prob, rng
        self.tried: set[tuple[tuple[str, int], ...]] = set()
        self.skipped: Counter[str] = Counter()
        self.space = math.prod(len(t.domain) for t in spec.tunables)
        mine = be.schedule_class if be.schedule_class in spec.schedules else be.device_class
        # "default" is what an untuned call runs: the device's schedule, the matrix-unit
        # one ("mma") where the device has matrix units and the dtype takes it (the baseline
        # was the plain schedule there, which such a device never runs by default)
        from ..runtime.configs import has_matrix_unit

        try:
            untuned = dict(spec.config(be.schedule_class, None, prob,
                                       matrix=has_matrix_unit(be)))
        except PortakernError:
            untuned = dict(spec.schedules.get(mine, {}))
        self.defaults: list[tuple[str, dict[str, Any]]] = [("default", untuned)]
        for c in spec.schedules:
            if dict(spec.schedules[c]) != untuned:
                self.defaults.append((f"default:{c}", dict(spec.schedules[c])))
        self.neighbours: list[dict[str, int]] = []

    def precheck(self, raw: Mapping[str, Any]) -> dict[str, int] | None:
        """The validated config, or None (counted in ``skipped``) if it cannot run here."""
        try:
            cfg = self.spec.config(self.be.schedule_class, raw, self.prob)
            launches = self.spec.launches(self.prob, cfg)
        except (InvalidArgumentError, SpecError, PortakernError) as exc:
            self.skipped["spec rejects it" if "invalid" in str(exc) or "domain" in str(exc)
                         else "launch geometry"] += 1
            return None
        wg = max((la.local[0] * la.local[1] * la.local[2] for la in launches), default=1)
        if wg > self.be.device.max_work_group_size:
            self.skipped[f"work-group > {self.be.device.max_work_group_size}"] += 1
            return None
        return cfg

    def _fresh(self, raw: Mapping[str, Any]) -> dict[str, int] | None:
        key = tuple(sorted(raw.items()))
        if key in self.tried:
            return None
        self.tried.add(key)
        return self.precheck(raw)

    def set_best(self, cfg: Mapping[str, int]) -> None:
        """Queue the untried one-step neighbours of a new best configuration."""
        out = []
        for t in self.spec.tunables:
            i = t.domain.index(cfg[t.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(t.domain):
                    out.append({**cfg, t.name: t.domain[j]})
        self.rng.shuffle(out)
        self.neighbours = out

    def next(self) -> tuple[str, dict[str, int]] | None:
        while self.defaults:
            origin, raw = self.defaults.pop(0)
            cfg = self._fresh(raw)
            if cfg is not None:
                return origin, cfg
        misses = 0
        while misses < 2000 and len(self.tried) < self.space:
            if self.neighbours and self.rng.random() < 0.6:
                raw: dict[str, Any] = self.neighbours.pop()
                origin = "greedy"
            else:
                raw = {t.name: t.domain[int(self.rng.integers(len(t.domain)))]
                       for t in self.spec.tunables}
                origin = "random"
            cfg = self._fresh(raw)
            if cfg is not None:
                return origin, cfg
            misses += 1
        return None


def _case_generator(spec: KernelSpec, table: Mapping[str, Any]) -> Callable[..., Any] | None:
    """Where random oracle cases come from: the built-in table, the spec's own ``cases``, or
    one derived from its declared shapes (portakern.tools.registration, when present)."""
    gen = table.get(spec.name) or getattr(spec, "cases", None)
    if gen is None:
        try:
            from ..core.spec_checks import derived_cases

            gen = derived_cases(spec)
        except Exception:  # no derivable generator: the measured problem is still checked
            gen = None
    return gen


def confirm(ok: list[Outcome], default: Outcome | None, say: Callable[[str], None],
            make_fn: Callable[[Mapping[str, int]], Callable[[], Any]],
            sync: Callable[[], None], deadline: float) -> Outcome | None:
    """Re-time the fastest few and the default in interleaved rounds and return the winner.

    Why: one median per candidate, taken minutes apart on a noisy machine, can crown a config
    that was merely lucky; alternating the finalists exposes them to the same noise. The
    winner's median_s becomes the median of its round medians (so does the default's)."""
    finalists = sorted(ok, key=lambda o: o.median_s or math.inf)[:CONFIRM_TOP]
    if default is not None and default.status == "ok" and default not in finalists:
        finalists.append(default)
    if len(finalists) < 2:
        return finalists[0] if finalists else None
    rounds: dict[int, list[float]] = {id(o): [] for o in finalists}
    fns = {id(o): make_fn(o.config) for o in finalists}
    for r in range(3):
        if r and time.monotonic() >= deadline:
            break
        for o in finalists:
            med, _, _ = time_call(fns[id(o)], sync, min_reps=3, min_time=MIN_TIME / 2)
            rounds[id(o)].append(med)
    for o in finalists:
        o.median_s = statistics.median(rounds[id(o)])
    win = min(finalists, key=lambda o: o.median_s or math.inf)
    say(f"confirmed in {len(rounds[id(win)])} interleaved round(s): " + "; ".join(
        f"{_fmt_cfg(o.config)} {_fmt_t(o.median_s)}{' (default)' if o is default else ''}"
        for o in sorted(finalists, key=lambda o: o.median_s or math.inf)))
    return win


def tune(op: str | KernelSpec, backend: str | Backend | None = None, *, budget_s: float = 60.0,
         sizes: Mapping[str, int] | None = None, dtype: str = "float32", seed: int = 0,
         max_candidates: int = 200, checks: int = 2, save: bool = True,
         out: Callable[[str], None] | None = None) -> TuneResult:
    """Search the op's tunables on one device and store the fastest oracle-correct schedule."""
    from ..api import call
    from ..backend.base import KernelBackend
    from ..core.sampling import Case, NumpyChooser
    from ..ops import get_op
    from ..runtime import selection
    from .cases import CASES, compare
    from .show import representative_problem

    say = out or (lambda s: print(s, flush=True))
    t_start = time.monotonic()
    if not (isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)):
        raise InvalidArgumentError(f"tune: budget must be a positive number of seconds; got "
                                   f"{budget_s!r}. Try --budget 60.")
    if not isinstance(max_candidates, int) or max_candidates < 1:
        raise InvalidArgumentError(f"tune: max_candidates must be >= 1; got {max_candidates!r}.")
    deadline = t_start + float(budget_s) * (1.0 - CONFIRM_SHARE)
    spec = op if isinstance(op, KernelSpec) else get_op(op)
    be = selection.resolve(backend)
    if not isinstance(be, KernelBackend):
        raise InvalidArgumentError(
            f"tune: {be.describe()} evaluates {spec.name}'s semantics with its own library and "
            "has no tunables; expected a backend that compiles portakern's C kernels (opencl, "
            "cuda). Pass --backend opencl or --backend cuda.")
    if not spec.tunables:
        raise InvalidArgumentError(f"tune: op {spec.name!r} declares no tunables; there is "
                                   "nothing to search. Give its KernelSpec `tunables`.")
    prob = representative_problem(spec, dtype, dict(sizes or {}))
    if prob.empty_result:
        raise InvalidArgumentError(
            f"{spec.name} with {dict(sizes or {})} is an empty problem (a size of 0): "
            "there is nothing to time, and its entry would serve every call of its size "
            "class. Give sizes >= 1.")
    be.check_dtype(spec, prob)
    rng = np.random.default_rng(seed)
    host = random_inputs(spec, prob, rng)
    native = {k: (be.as_input(k, v) if v is not None else None) for k, v in host.items()}
    params = dict(prob.params)
    full_check = spec.cost(prob).flops <= ORACLE_FLOPS_LIMIT
    gen = _case_generator(spec, CASES)
    n_random = max(0, int(checks)) if gen else 0

    def check_cases(k: int) -> list[tuple[bool, Case]]:
        """Fresh inputs for candidate k: values no earlier candidate saw, so an output buffer
        that happens to hold a previous correct result cannot make a broken kernel pass."""
        r = np.random.default_rng([seed, k])
        got = [(True, Case(random_inputs(spec, prob, r), params, "the measured problem"))
               ] if full_check else []
        return got + [(False, gen(NumpyChooser(r), dtype)) for _ in range(n_random)]

    search = _Search(spec, be, prob, rng)
    n_max = min(max_candidates, search.space)
    b = bucket(prob)
    flops = spec.cost(prob).flops
    say(f"tuning {spec.name} on {be.describe()} for {bucket_label(b)} "
        f"(shapes {', '.join(f'{k}={tuple(v)}' for k, v in prob.shapes.items() if v is not None)}"
        f"; {dtype}); budget {budget_s:g} s, up to {n_max} candidates of {search.space}; "
        f"oracle checks: {'measured problem + ' if full_check else ''}{n_random} "
        "random case(s) per candidate")

    def run_once(cfg: Mapping[str, int], arrays: Mapping[str, Any], prm: Mapping[str, Any]
                 ) -> Any:
        return call(spec, backend=be, config=cfg, **arrays, **prm)

    def evaluate(origin: str, cfg: dict[str, int], cutoff: float | None) -> Outcome | None:
        try:
            kernels = be.kernels_for(spec, prob, cfg)
        except Exception as exc:
            return Outcome(cfg, origin, "failed", note=f"compile: {_short(exc)}")
        launches = spec.launches(prob, cfg)
        wg = max((la.local[0] * la.local[1] * la.local[2] for la in launches), default=1)
        for k in kernels.values():
            local, most = be.kernel_limits(k)
            if local is not None and local > be.device.local_mem_bytes:
                search.skipped[f"local memory > {be.device.local_mem_bytes} B"] += 1
                return None
            if most is not None and wg > most:
                search.skipped["work-group > compiled kernel's limit"] += 1
                return None
        try:
            for measured, case in check_cases(len(outcomes) + 1):
                try:
                    res = run_once(cfg, case.arrays, case.params)
                except InvalidArgumentError:
                    if measured:
                        raise
                    continue  # this schedule does not apply to that problem; lookups agree
                v = compare(spec, case, res)
                if not v.ok:
                    return Outcome(cfg, origin, "rejected", note=f"wrong on {case.describe()}: "
                                   f"error {v.worst_ratio:.3g}x the bound {v.where}")
            med, n, complete = time_call(lambda: run_once(cfg, native, params), be.synchronize,
                                         deadline=None if origin == "default" else deadline,
                                         cutoff=cutoff)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            return Outcome(cfg, origin, "failed", note=f"run: {_short(exc)}")
        return Outcome(cfg, origin, "ok" if complete else "slower", med, n,
                       "" if complete else "cut short")

    outcomes: list[Outcome] = []
    best: Outcome | None = None
    default: Outcome | None = None
    interrupted = False
    i = 0
    try:
        while i < n_max and (i == 0 or time.monotonic() < deadline):
            nxt = search.next()
            if nxt is None:
                say("search space exhausted")
                break
            origin, cfg = nxt
            res = evaluate(origin, cfg, best.median_s * PRUNE_FACTOR if best and best.median_s
                           else None)
            if res is None:
                continue
            i += 1
            outcomes.append(res)
            if origin == "default":
                default = res
            if res.status == "ok" and (best is None or (res.median_s or 0) < (best.median_s or 0)):
                best = res
                search.set_best(res.config)
            left = max(0.0, deadline - time.monotonic())
            gf = f" {flops / res.median_s / 1e9:7.2f} GFLOP/s" if res.median_s and flops else ""
            state = {"ok": "ok", "slower": "slower, cut short"}.get(res.status, res.status)
            line = (f"[{i:>3}/{n_max}] {origin:<14} {_fmt_cfg(cfg):<48} "
                    f"{_fmt_t(res.median_s):>10}{gf}  {state}")
            if res.note and res.status in ("rejected", "failed"):
                line += f": {res.note[:240]}{'...' if len(res.note) > 240 else ''}"
            if best is not None:
                sp = (f", {default.median_s / best.median_s:.2f}x vs default"
                      if default and default.median_s and best.median_s else "")
                line += f" | best {_fmt_t(best.median_s)}{sp} | {left:.0f} s left"
            say(line)
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: keeping the best verified candidate so far")
    if best is not None and not interrupted:
        best = confirm([o for o in outcomes if o.status == "ok"], default, say,
                       lambda cfg: (lambda: run_once(cfg, native, params)), be.synchronize,
                       t_start + float(budget_s))
    if search.skipped:
        say("skipped before timing: " + ", ".join(f"{n} ({why})"
                                                   for why, n in search.skipped.most_common()))
    stored: Path | None = None
    if best is None:
        say("no candidate passed the oracle check; nothing stored")
    else:
        sp = (f" = {default.median_s / best.median_s:.2f}x the default ({_fmt_t(default.median_s)})"
              if default and default.median_s and best.median_s else "")
        say(f"best: {_fmt_cfg(best.config)}  {_fmt_t(best.median_s)}{sp}")
        if save:
            fp = fingerprint(be)
            payload = make_entry(fp, spec, prob, best.config, time_s=best.median_s,
                                 default_time_s=default.median_s if default else None,
                                 default_config=default.config if default else None,
                                 candidates=i, budget_s=float(budget_s), seed=seed,
                                 interrupted=interrupted)
            stored = save_entry(payload)
            say(f"stored: {stored}" if stored else "NOT stored: the cache is not writable "
                "(see the warning above)")
    return TuneResult(spec.name, be.label, b, best, default, outcomes, search.skipped, stored,
                      time.monotonic() - t_start)


# --- command line -------------------------------------------------------------------------
def _all_device_keys() -> list[str]:
    base = Store(NAMESPACE).path
    try:
        return sorted(p.name for p in base.iterdir()
                      if not p.is_symlink() and p.is_dir() and _DEVKEY_RE.match(p.name))
    except OSError:
        return []


def _cmd(args: argparse.Namespace) -> int:
    from ..runtime import selection
    from .show import parse_sizes

    if args.list:
        base = Store(NAMESPACE).path
        print(f"tuning database: {base}")
        if mode() == "off":
            print(f"(lookups are disabled by ${ENV_TUNING}={settings.Tuning.mode.text()})")
        keys = _all_device_keys()
        if not keys:
            print("  nothing tuned yet; run `portakern tune OP --backend B`")
        for devkey in keys:
            rows = list(device_entries(devkey))
            dev = next((e.device for e in rows if isinstance(e, Entry)), {})
            print(f"  {devkey}: {dev.get('backend', '?')} {dev.get('name', '?')} "
                  f"[{dev.get('vendor', '')} {dev.get('driver', '')}]")
            for e in rows:
                if isinstance(e, Entry):
                    print(f"    {format_entry(summarize(e))}")
                else:
                    print(f"    unusable {e[0]}: {e[1]}")
        return 0
    if args.clear:
        # only what portakern wrote (entry name + valid envelope), never through a symlink;
        # everything else is left and listed
        if args.backend:
            be = selection.resolve(args.backend)
            st = store_for(device_key(fingerprint(be)))
            what = f" of {be.describe()}"
        else:
            st, what = Store(NAMESPACE), ""
        removed, left = st.clear_report()
        n = sum(1 for p in removed if p.name.endswith(".json"))
        print(f"removed {n} tuned entr{'y' if n == 1 else 'ies'}{what} from {st.path}")
        if left:
            print(f"left {len(left)} path{'' if len(left) == 1 else 's'} that portakern did "
                  "not write (or cannot remove):")
            for p, why in left[:50]:
                print(f"  {p}: {why}")
            if len(left) > 50:
                print(f"  ... and {len(left) - 50} more")
        invalidate()
        return 0
    if getattr(args, "static", False):  # no GPU: rank by static figures (resources.py)
        return _static(args)
    if not args.op:
        print("portakern tune: name an op (e.g. `portakern tune matmul --backend opencl`), or "
              "use --list / --clear", file=sys.stderr)
        return 2
    try:
        res = tune(args.op, args.backend, budget_s=args.budget, sizes=parse_sizes(args.shape),
                   dtype=args.dtype, seed=args.seed, max_candidates=args.max_candidates,
                   checks=args.checks, save=not args.no_save)
    except PortakernError as exc:
        print(f"portakern tune: {exc}", file=sys.stderr)
        return 2
    if res.best is None:
        return 1
    return 0 if (res.stored or args.no_save) else 1


def _static(args: argparse.Namespace) -> int:
    from .resources import static_tune

    if not args.op or not args.backend:
        print("portakern tune --static: name an op and --backend cuda or hip", file=sys.stderr)
        return 2
    try:
        res = static_tune(args.op, args.backend, args.dtype,
                          max_candidates=min(args.max_candidates, 24), save=not args.no_save)
    except PortakernError as exc:
        print(f"portakern tune --static: {exc}", file=sys.stderr)
        return 2
    return 0 if res["best"] is not None else 1


def add_tune_parser(sub: Any) -> None:
    """Register `portakern tune` (cli.py calls this when the module is importable)."""
    s = sub.add_parser(
        "tune", help="autotune an op's schedule on a device and remember it",
        description="Search an op's tunables on one device, reject every candidate that fails "
                    "the float64 oracle, and store the fastest in the per-device tuning "
                    "database that ops and the benchmark read. See docs/tuning.md.")
    s.add_argument("op", nargs="?", help="op to tune: matmul, softmax, attention, ...")
    s.add_argument("--backend", default=None, help="backend selector, e.g. opencl or cuda:0 "
                   "(default: automatic selection)")
    s.add_argument("--budget", type=float, default=60.0, help="seconds to search (default 60)")
    s.add_argument("--shape", default=None, help="problem sizes, e.g. 'M=512,N=512,K=512' "
                   "(default: the op's representative problem, as `portakern show`)")
    s.add_argument("--dtype", default="float32", help="dtype to tune for (default float32)")
    s.add_argument("--seed", type=int, default=0, help="random search seed (default 0)")
    s.add_argument("--max-candidates", type=int, default=200,
                   help="stop after this many measured candidates (default 200)")
    s.add_argument("--checks", type=int, default=2,
                   help="random oracle cases each candidate must pass (default 2)")
    s.add_argument("--no-save", action="store_true", help="search and report, store nothing")
    s.add_argument("--static", action="store_true",
                   help="no GPU: rank candidate GPU schedules by compiler figures (spills "
                        "rejected, occupancy) for --backend cuda|hip; recorded as static "
                        "choices to confirm on a GPU (portakern resources)")
    s.add_argument("--list", action="store_true", help="list the tuning database and exit")
    s.add_argument("--clear", action="store_true",
                   help="delete tuned entries (of --backend's device, else all) and exit")
    s.set_defaults(fn=_cmd)

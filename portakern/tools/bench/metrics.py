"""The benchmark's arithmetic: efficiency, performance portability, roofline. Pure functions.

Definitions (docs/bench.md explains each column):

- application efficiency of a case on one platform = peer time / our time, with the peer the
  fastest native implementation measured on that same device in the same run. 1.0 means we
  match the vendor library, 0.25 means we take 4x as long; above 1.0 we beat it (Pennycook's
  strict form caps at 1 because "best known" would then be us; we keep the raw ratio so the
  table shows by how much, and ``cap=True`` gives the strict form).
- performance portability (Pennycook, Sewall, Lee 2016) of a case over a platform set H:
  |H| / sum_i 1/e_i (the harmonic mean) if every platform in H runs the case, else 0. A
  platform that cannot run it is not dropped: dropping it would call a kernel "portable"
  exactly where it is not.
- roofline (Williams, Waterman, Patterson 2009): attainable FLOP/s = min(peak, bw * I) with
  I = flops / bytes of the op's cost model; the equivalent time bound is
  max(flops / peak, bytes / bw), and % of roofline = bound time / measured time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .timing import quantile


def efficiency(peer_s: float | None, ours_s: float | None, *, cap: bool = False) -> float | None:
    """Application efficiency peer_s / ours_s; None when either time is missing or invalid."""
    if peer_s is None or ours_s is None:
        return None
    if not (math.isfinite(peer_s) and math.isfinite(ours_s)) or peer_s <= 0 or ours_s <= 0:
        return None
    e = peer_s / ours_s
    return min(e, 1.0) if cap else e


def paired_ratios(num_s: Sequence[float], den_s: Sequence[float]) -> dict[str, Any] | None:
    """The per-round ratios num[r] / den[r] of two implementations sampled in the same rounds
    (timing.run_rounds), summarised: ``median`` (what the tables report), ``q1``/``q3``,
    ``min``/``max``, ``n`` rounds and every ratio (``per_round``). Rounds where either sample
    is missing or not positive are left out; None when no round remains.

    Why per round: a burst of load that hits one implementation's samples changes the ratio
    of the two medians, but only the ratios of the rounds it hit; their median ignores it."""
    rs = [float(a) / float(b) for a, b in zip(num_s, den_s)
          if a is not None and b is not None and a > 0 and b > 0
          and math.isfinite(a) and math.isfinite(b)]
    if not rs:
        return None
    xs = sorted(rs)
    return {"median": quantile(xs, 0.5), "q1": quantile(xs, 0.25), "q3": quantile(xs, 0.75),
            "min": xs[0], "max": xs[-1], "n": len(xs), "per_round": rs}


def best_peer(times: Mapping[str, float | None]) -> tuple[str, float] | None:
    """The fastest peer (name, seconds) among those with a valid time; None if there is none."""
    valid = [(t, k) for k, t in times.items() if t is not None and math.isfinite(t) and t > 0]
    if not valid:
        return None
    t, k = min(valid)
    return k, t


def harmonic_mean(values: Iterable[float]) -> float:
    """Harmonic mean of non-negative values; 0 if any value is 0. Raises on empty/negative."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("harmonic_mean of no values; expected at least one.")
    if any(x < 0 or math.isnan(x) for x in xs):
        raise ValueError(f"harmonic_mean needs non-negative numbers; got {xs}.")
    if any(x == 0 for x in xs):
        return 0.0
    return len(xs) / sum(1.0 / x for x in xs)


@dataclass(frozen=True)
class Portability:
    """PP of one case over a platform set, and why it is what it is."""

    value: float | None  # None: no platform in the set
    platforms: tuple[str, ...]
    unsupported: tuple[str, ...] = field(default=())  # platforms that cannot run the case

    @property
    def supported_everywhere(self) -> bool:
        return not self.unsupported


def performance_portability(efficiencies: Mapping[str, float | None]) -> Portability:
    """Pennycook's PP over the platforms in ``efficiencies``.

    A value of None means that platform cannot run the case (unsupported dtype, kernel error,
    not runnable): PP is then 0 and the platform is named in ``unsupported``. Platforms whose
    efficiency is merely unknown (no peer to compare with) must be left out by the caller and
    reported as such; they are neither 0 nor 1.
    """
    names = tuple(efficiencies)
    if not names:
        return Portability(None, ())
    unsupported = tuple(k for k, e in efficiencies.items() if e is None)
    if unsupported:
        return Portability(0.0, names, unsupported)
    vals = [float(e) for e in efficiencies.values() if e is not None]  # none is, now
    return Portability(harmonic_mean(vals), names, ())


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity in FLOP per byte of compulsory traffic (inf when no bytes)."""
    return flops / nbytes if nbytes > 0 else math.inf


def roofline_gflops(peak_gflops: float, bw_gbs: float, arith_intensity: float) -> float:
    """Attainable GFLOP/s = min(peak, bandwidth * intensity)."""
    if peak_gflops <= 0 or bw_gbs <= 0:
        raise ValueError(f"roofline needs positive peak and bandwidth; got peak={peak_gflops}, "
                         f"bw={bw_gbs}. Run the probes on this device first.")
    return min(peak_gflops, bw_gbs * arith_intensity)


def roofline_time(flops: float, nbytes: float, peak_gflops: float, bw_gbs: float) -> float:
    """Lower bound on time (s): max(flops / peak, bytes / bw)."""
    if peak_gflops <= 0 or bw_gbs <= 0:
        raise ValueError(f"roofline needs positive peak and bandwidth; got peak={peak_gflops}, "
                         f"bw={bw_gbs}.")
    return max(flops / (peak_gflops * 1e9), nbytes / (bw_gbs * 1e9))


def bound_kind(flops: float, nbytes: float, peak_gflops: float, bw_gbs: float) -> str:
    """'compute' or 'memory': which roof limits the case on this device."""
    return "compute" if flops / (peak_gflops * 1e9) >= nbytes / (bw_gbs * 1e9) else "memory"


def pct_of_roofline(measured_s: float, flops: float, nbytes: float, peak_gflops: float,
                    bw_gbs: float) -> float:
    """100 * roofline time / measured time (100 = at the roof; above 100 = the probes
    underestimate the device, e.g. a peer using tensor cores or the cache)."""
    if measured_s <= 0:
        raise ValueError(f"measured time must be positive; got {measured_s}.")
    # the ratio first: roofline time <= measured time then gives at most 100 exactly
    return 100.0 * (roofline_time(flops, nbytes, peak_gflops, bw_gbs) / measured_s)


def achieved(measured_s: float, flops: float, nbytes: float) -> tuple[float, float]:
    """(GFLOP/s, GB/s) achieved, from the cost model's flops and compulsory bytes."""
    if measured_s <= 0:
        raise ValueError(f"measured time must be positive; got {measured_s}.")
    return flops / measured_s / 1e9, nbytes / measured_s / 1e9


# --- which physical device a record ran on (report and plots) ------------------------------
def cpu_model_of(result: Mapping[str, Any]) -> str | None:
    """The CPU a result file was measured on, if recorded: ``environment.cpu.model`` with its
    vector ISA and, where recorded, its family and model numbers, e.g. ``AMD EPYC (AVX-512,
    family 25 model 17)``. The model name alone does not name the silicon: these VMs report
    "AMD EPYC" for a Zen 1 (AVX2) and a Zen 4 (AVX-512) alike, and the report merged the two
    as one processor. Files without the numbers (before 2026-12-07) keep the ISA, which every
    file records."""
    cpu = (result.get("environment") or {}).get("cpu") or {}
    model = cpu.get("model")
    if not model:
        return None
    simd = set(cpu.get("simd") or ())
    parts = (["AVX-512"] if "avx512f" in simd else ["AVX2"] if "avx2" in simd
             else ["SVE"] if "sve" in simd else ["NEON"] if simd & {"neon", "asimd"} else [])
    if cpu.get("family") is not None and cpu.get("model_number") is not None:
        parts.append(f"family {cpu['family']} model {cpu['model_number']}")
    return f"{model} ({', '.join(parts)})" if parts else str(model)


def device_key(kind: str, name: str, host: str, cpu_model: str | None = None) -> str:
    """The key of one physical device: ``cpu:<model> @ host``, ``gpu:<name> @ host``.

    A CPU carries its model because a hostname does not name the silicon: the VMs we bench on
    are all called ``vm``, one day an AVX-512 Xeon, another an AVX2 EPYC, and ``cpu @ vm`` put
    both under one device, so the report compared and merged their numbers as one processor.
    Without a model (an older file, no /proc/cpuinfo) the key is ``cpu @ host``, as before.
    Whitespace in the model is collapsed so the key is the same however /proc/cpuinfo pads it.
    """
    if kind == "cpu":
        model = " ".join(str(cpu_model or "").split())
        return f"cpu:{model} @ {host}" if model else f"cpu @ {host}"
    return f"{kind}:{name.strip()} @ {host}"


def device_key_of(target: Mapping[str, Any], host: str, cpu_model: str | None = None) -> str:
    """The physical device a target runs on: all CPU targets of one machine are one device.

    ``cpu_model`` is the result's CPU (``cpu_model_of``). Files written before CPU keys
    carried the model store ``cpu @ host``, and later ones ``cpu:<model> @ host`` without the
    ISA and numbers; such a key (or a missing one) is rebuilt from ``cpu_model``, so an old
    Xeon file, a Zen 1 file and a Zen 4 file of the same host become three devices and match
    the keys new files of those machines store.
    """
    stored = str(target.get("device_key") or "")
    if stored.startswith("cpu @ ") or (cpu_model and stored.startswith("cpu:")):
        # a CPU key is rebuilt from the file's CPU: older keys named the model alone
        return device_key("cpu", "", stored.rsplit(" @ ", 1)[-1], cpu_model)
    if stored:
        return stored
    dev = target.get("device") or {}
    return device_key(str(dev.get("kind", "?")), str(dev.get("name", "?")), host, cpu_model)


def implementation_of(label: str, target: Mapping[str, Any] | None) -> str:
    """The implementation a target runs: its backend and its device's implementation alias
    where the backend gives one (``opencl:pocl`` and ``opencl:intel``: two OpenCL runtimes on
    one CPU, two implementations), else its backend alone (``jax`` for jax:0 and jax:pallas_0:
    one library with two lowerings; ``cuda``). Data only: the alias is the backend's
    ``device.extra["alias"]``, recorded in the result's targets."""
    t = target or {}
    if t.get("implementation"):
        return str(t["implementation"])
    backend = str(t.get("backend") or label.split(":", 1)[0])
    alias = ((t.get("device") or {}).get("extra") or {}).get("alias")
    return f"{backend}:{alias}" if alias else backend


def target_title(label: str, implementation: str | None) -> str:
    """'opencl:1 = opencl:intel': a target's selector with its implementation beside it where
    the implementation says more than the backend's name (``jax:0`` stays ``jax:0``)."""
    if not implementation or implementation == label or implementation == label.split(":")[0]:
        return label
    return f"{label} = {implementation}"


def attach_devices(result: Mapping[str, Any]) -> None:
    """Give every case record of a result its ``device_key`` and ``implementation`` (older
    files lack them), and give a bare ``cpu @ host`` key the result's CPU model
    (``device_key_of`` says why)."""
    host = (result.get("environment") or {}).get("hostname", "?")
    model = cpu_model_of(result)
    targets = result.get("targets") or {}
    keys = {lab: device_key_of(t, host, model) for lab, t in targets.items()}
    impls = {lab: implementation_of(lab, t) for lab, t in targets.items()}
    for rec in [*result.get("cases", []), *((result.get("hog") or {}).get("cases") or [])]:
        stored = rec.get("device_key") or keys.get(rec.get("target", ""))
        rec["device_key"] = device_key_of(
            {"device_key": stored or f"{rec.get('device')} @ {host}"}, host, model)
        if not rec.get("implementation"):
            lab = str(rec.get("target", "?"))
            rec["implementation"] = impls.get(lab) or implementation_of(lab, None)


def skipped(r: Mapping[str, Any]) -> bool:
    """A target record the bench chose not to measure (``not_applicable``: a peer budget, a
    split row): not measured, where an unsupported dtype or an error is a target that cannot
    run (the same-silicon view and the per-device tables both read it so)."""
    return (r.get("ours") or {}).get("status") == "not_applicable"

"""The implementations on one device side by side: the portability gap between vendors on the
same silicon (issue 27).

PP over devices (report.py) asks whether portakern runs well on every processor of a fleet.
This view asks the question one level down: on *one* processor, how much does the choice of
implementation cost — PoCL or Intel's OpenCL runtime on the same CPU, jax, or plain numpy.
For one case (op, dtype, size) on one device (``device_key``):

- **H**, the implementations, is fixed per device: each portakern implementation measured on
  it, grouped by backend and implementation alias (``metrics.implementation_of``:
  ``opencl:pocl`` and ``opencl:intel`` are two members; ``jax:0`` and ``jax:pallas_0`` are one,
  ``jax``, at the faster of its two lowerings, the target named in its cell), plus the numpy
  peer wherever it was measured (a CPU): the array library every user already has, timed as a
  peer, counted here as an implementation;
- **fastest** = the lowest median among the members of H *and every other peer* measured on
  the device for the case (torch, XLA, CLBlast, ...). A peer measured beside several targets
  (numpy, torch and XLA run beside each) counts with its fastest measurement;
- **efficiency** of a member = fastest / its time, in (0, 1]: Pennycook's application
  efficiency against the best observed implementation; **% roof** = 100 × the case's roofline
  time on the device (the smallest bound of its records: the highest roof) / its time;
- **PP** = the harmonic mean of the members' efficiencies, **0 if a member cannot run the
  case** (a portakern target that ran it with any status but ok: unsupported dtype, kernel
  error, interrupted; or a numpy peer whose status is ``unsupported``); **PP (roofline)** the
  same over % roof / 100. A member with no measurement of the case (another run's suite, a
  numpy peer ``unavailable`` for the dtype or not asked for, a target the bench itself
  skipped, ``not_applicable``: jax's paged decode past the gather budget) is *not measured*:
  left out of that case's PP and named, as unknown is not unsupported.

The times of two members come from different rounds of the run (each target's case is its own
measurement), so these are ratios of medians; the paired per-round ratios against each peer
stay in the run table. The tables are report.silicon_tables, the plot
plots.plot_implementations. docs/bench.md ("Implementations on the same silicon") says why
application efficiency against the best observed, and what H holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import metrics
from .peers import NUMPY_PEER

NUMPY_MEMBER = "numpy"  # the numpy peer's name as a member of H


@dataclass
class Member:
    """One implementation's result for one case on one device."""

    name: str  # the member of H (opencl:pocl, jax, numpy) or a peer's name
    time_s: float | None = None  # median; None: did not run
    source: str = ""  # the target that gave the time, where a member has several (jax)
    status: str = "ok"  # ok | cannot run | not measured
    reason: str = ""
    efficiency: float | None = None  # fastest / time_s
    roof: float | None = None  # % of roof / 100
    contended: bool = False

    @property
    def ran(self) -> bool:
        return self.status == "ok" and self.time_s is not None


@dataclass
class SiliconCase:
    """One case on one device: every member of H and every other peer, the fastest, PP."""

    key: tuple[str, str, str]  # (op, dtype, label)
    device: str
    flops: float
    members: dict[str, Member] = field(default_factory=dict)  # in H's order
    peers: dict[str, Member] = field(default_factory=dict)  # peer key -> its fastest
    fastest: str | None = None  # display name of the fastest implementation or peer
    fastest_s: float | None = None
    bound_s: float | None = None  # roofline time of the case on the device
    pp_app: metrics.Portability | None = None
    pp_roof: metrics.Portability | None = None
    not_measured: list[str] = field(default_factory=list)
    no_roof: list[str] = field(default_factory=list)


def _ok_time(m: Mapping[str, Any] | None) -> float | None:
    if not m or m.get("status") != "ok":
        return None
    t = m.get("median_s")
    return float(t) if t is not None and math.isfinite(t) and t > 0 else None


def device_of(rec: Mapping[str, Any]) -> str:
    return str(rec.get("device_key") or rec.get("platform") or "?")


def member_of(rec: Mapping[str, Any]) -> str:
    """The member of H a portakern target's record belongs to."""
    return str(rec.get("implementation") or metrics.implementation_of(rec.get("target", "?"),
                                                                      None))


def members(records: Sequence[Mapping[str, Any]], device: str) -> list[str]:
    """H on ``device``: the portakern implementations in the order their targets first
    appear (a run lists them in its target order), then numpy where its peer was measured."""
    out: list[str] = []
    numpy = False
    for r in records:
        if device_of(r) != device:
            continue
        name = member_of(r)
        if name not in out:
            out.append(name)
        if NUMPY_PEER in (r.get("peers") or {}):
            numpy = True
    return out + ([NUMPY_MEMBER] if numpy and NUMPY_MEMBER not in out else [])


def _bound(recs: Sequence[Mapping[str, Any]]) -> float | None:
    bs = [float(b) for r in recs
          if (b := (r.get("roofline") or {}).get("bound_s")) is not None and b > 0]
    return min(bs) if bs else None


def silicon_case(key: tuple[str, str, str], device: str, h: Sequence[str],
                 recs: Sequence[Mapping[str, Any]]) -> SiliconCase:
    """The implementations view of one case on one device from its target records there."""
    c = SiliconCase(key, device, max(float((r.get("cost") or {}).get("flops") or 0.0)
                                     for r in recs) if recs else 0.0)
    c.bound_s = _bound(recs)
    by_member: dict[str, list[Mapping[str, Any]]] = {}
    for r in recs:
        by_member.setdefault(member_of(r), []).append(r)
    for name in h:
        if name == NUMPY_MEMBER and name not in by_member:
            continue  # filled from the peers below
        group = by_member.get(name)
        if not group:
            c.members[name] = Member(name, status="not measured",
                                     reason="no record of this case")
            continue
        several = len({r.get("target") for r in group}) > 1
        ran = [(t, r) for r in group if (t := _ok_time(r.get("ours"))) is not None
               and r.get("supported", True)]
        if ran:
            t, r = min(ran, key=lambda x: x[0])
            c.members[name] = Member(name, t, str(r.get("target")) if several else "",
                                     contended=bool(r.get("contended")))
        else:
            why = "; ".join(f"{r.get('target')}: {(r.get('ours') or {}).get('status', '?')}"
                            for r in group)
            # skipped by the bench's own choice (not_applicable) is not measured; anything
            # else (unsupported, an error, interrupted) is a member that cannot run it
            skipped = all(metrics.skipped(r) for r in group)
            c.members[name] = Member(name, source=", ".join(str(r.get("target"))
                                                            for r in group),
                                     status="not measured" if skipped else "cannot run",
                                     reason=why)
    # every peer at its fastest measurement on the device (it ran beside each target)
    seen: dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = {}
    for r in recs:
        for k, m in (r.get("peers") or {}).items():
            seen.setdefault(k, []).append((r, m))
    for k, ms in seen.items():
        timed = [(t, r, m) for r, m in ms if (t := _ok_time(m)) is not None]
        name = str(ms[0][1].get("name", k))
        if timed:
            t, r, m = min(timed, key=lambda x: x[0])
            peer = Member(str(m.get("name", k)), t, contended=bool(r.get("contended")))
        else:
            statuses = sorted({str(m.get("status", "?")) for _, m in ms})
            reasons = sorted({str(m.get("reason", ""))[:120] for _, m in ms} - {""})
            peer = Member(name, status=("cannot run" if statuses == ["unsupported"]
                                        else "not measured"),
                          reason="/".join(statuses) + (": " + "; ".join(reasons)
                                                        if reasons else ""))
        if k == NUMPY_PEER and NUMPY_MEMBER in h and NUMPY_MEMBER not in by_member:
            c.members[NUMPY_MEMBER] = Member(NUMPY_MEMBER, peer.time_s, peer.source,
                                             peer.status, peer.reason,
                                             contended=peer.contended)
        else:
            c.peers[k] = peer
    if NUMPY_MEMBER in h and NUMPY_MEMBER not in c.members:
        c.members[NUMPY_MEMBER] = Member(NUMPY_MEMBER, status="not measured",
                                         reason="no numpy peer in this case's records")
    c.members = {n: c.members[n] for n in h if n in c.members}  # H's order
    timed_all = [(m.time_s, m.name) for m in [*c.members.values(), *c.peers.values()]
                 if m.ran and m.time_s is not None]
    if timed_all:
        c.fastest_s, c.fastest = min(timed_all)
    for m in [*c.members.values(), *c.peers.values()]:
        if m.ran and m.time_s and c.fastest_s:
            m.efficiency = c.fastest_s / m.time_s
            if c.bound_s:
                m.roof = c.bound_s / m.time_s
    app: dict[str, float | None] = {}
    roof: dict[str, float | None] = {}
    for name, m in c.members.items():
        if m.status == "not measured":
            c.not_measured.append(name)
        elif m.status == "cannot run":
            app[name] = roof[name] = None
        else:
            app[name] = m.efficiency
            if m.roof is not None:
                roof[name] = m.roof
            else:
                c.no_roof.append(name)
    c.pp_app = metrics.performance_portability(app)
    c.pp_roof = metrics.performance_portability(roof)
    return c


def silicon_cases(records: Sequence[Mapping[str, Any]], devices: Sequence[str]
                  ) -> list[SiliconCase]:
    """Per device with at least two implementations, per case: the implementations view.
    (A device with one has nothing to put side by side; PP over devices covers it.)"""
    out = []
    for d in devices:
        h = members(records, d)
        if len(h) < 2:
            continue
        groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
        for r in records:
            if device_of(r) == d:
                groups.setdefault((r["op"], r["dtype"], r["label"]), []).append(r)
        out += [silicon_case(k, d, h, g) for k, g in groups.items()]
    out.sort(key=lambda c: (list(devices).index(c.device), c.key[0], c.key[1], c.flops,
                            c.key[2]))
    return out

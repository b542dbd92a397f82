"""Tables and the fleet report: one run's markdown, and `portakern report` over many runs.

The unit of Pennycook's performance portability here is a **device**: one physical processor
of one machine (``cpu:<model> @ host``, ``gpu:<name> @ host``: a hostname alone does not name
the silicon, see metrics.device_key). Several portakern targets can run on one device
(opencl:0, jax:0 and jax:pallas_0 on one CPU); they are compared side by side on that device,
never averaged as if they were platforms (docs/bench.md says why). For each case
(op, dtype, size, parameters):

- efficiency of a target = best peer time / its time on that device (None: no peer ran);
- per device, the *best portakern target* is the one with the highest efficiency;
- PP (best) = harmonic mean over the devices of the best target's efficiency, 0 if a device
  cannot run the case with any target; PP (kind) = the same for one target kind (opencl, jax,
  jax:pallas, cuda) over the devices that have it;
- the same over % of roofline / 100 (architectural efficiency), which exists even where no
  vendor peer does.

A device that did not measure a case at all (another suite, an interrupted run) is listed as
"not measured" and left out of that case's PP: it is unknown, not unsupported. A device that
ran a case but had no peer is left out of the application-efficiency PP and named.

One level down, per device, the *implementations on the same silicon* (PoCL and Intel's
OpenCL on one CPU, jax, numpy) get a view of their own with PP over them
(implementations.py); both the run's markdown and REPORT.md print it after the device PP.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import metrics
from .implementations import (
    NUMPY_MEMBER,
    Member,
    SiliconCase,
    device_of,
    member_of,
    members,
    silicon_cases,
)
from .metrics import attach_devices, cpu_model_of, device_key_of, skipped, target_title

SCHEMA_PREFIX = "portakern-bench/"
CONTENTION_NOTE = 0.10  # flag cases during which others used more than this share of the CPUs


# --- formatting ---------------------------------------------------------------------------------
def fmt_time(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "—"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_num(x: float | None, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.{digits}g}"


def fmt_pct(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def timing_cell(m: Mapping[str, Any] | None) -> str:
    if not m:
        return "—"
    if m.get("status") == "not_applicable":
        return "n/a"
    if m.get("status") != "ok" or m.get("median_s") is None:
        return f"{m.get('status', '?')}"
    med, q1, q3 = m["median_s"], m.get("q1_s", m["median_s"]), m.get("q3_s", m["median_s"])
    spread = 100 * (q3 - q1) / 2 / med if med else 0.0
    return f"{fmt_time(med)} ±{spread:.0f}% (n={m.get('reps', '?')})"


# --- loading ------------------------------------------------------------------------------------
def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a result file; say what is wrong with it if it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"result file {p} does not exist; expected a JSON file written "
                                "by `portakern bench --out`.") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON ({exc}); expected a file written by "
                         "`portakern bench --out` (was the run killed mid-write?).") from None
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith(SCHEMA_PREFIX):
        raise ValueError(f"{p} is not a portakern bench result (schema {data.get('schema')!r} "
                         f"if any; expected {SCHEMA_PREFIX}N). Pass files written by "
                         "`portakern bench`.")
    data.setdefault("cases", [])
    data["_path"] = str(p)
    return data


def case_key(rec: Mapping[str, Any]) -> tuple[str, str, str]:
    """Same op, dtype and size label = the same case on every platform."""
    return rec["op"], rec["dtype"], rec["label"]


def _flops(rec: Mapping[str, Any]) -> float:
    return float(rec.get("cost", {}).get("flops") or 0.0)


# --- portability over devices -------------------------------------------------------------------
def target_kind(label: str) -> str:
    """'opencl:0' -> 'opencl', 'jax:pallas_0' -> 'jax:pallas', 'cuda:1' -> 'cuda'."""
    return re.sub(r"[:_]?\d+$", "", label) or label


def _roof_frac(rec: Mapping[str, Any]) -> float | None:
    pct = (rec.get("achieved") or {}).get("ours", {}).get("pct_roofline")
    return None if pct is None else float(pct) / 100.0


@dataclass
class CasePP:
    """One case over the devices: each target's numbers, the best per device, and PP."""

    key: tuple[str, str, str]
    flops: float
    records: dict[str, dict[str, Mapping[str, Any]]] = field(default_factory=dict)  # dev->lab
    best: dict[str, str | None] = field(default_factory=dict)  # device -> best target label
    efficiency: dict[str, float | None] = field(default_factory=dict)  # device -> best's
    roofline: dict[str, float | None] = field(default_factory=dict)
    no_peer: list[str] = field(default_factory=list)
    no_roof: list[str] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)
    pp_app: metrics.Portability | None = None
    pp_roof: metrics.Portability | None = None
    pp_kind: dict[str, metrics.Portability] = field(default_factory=dict)
    kind_missing: dict[str, list[str]] = field(default_factory=dict)  # kind -> devices without


def portability(records: Sequence[Mapping[str, Any]], devices: Sequence[str]
                ) -> list[CasePP]:
    """Per case: the targets on each device side by side, the best one, PP over devices."""
    groups: dict[tuple[str, str, str], dict[str, dict[str, Mapping[str, Any]]]] = {}
    for r in records:
        dev = r.get("device_key") or r.get("platform", "?")
        groups.setdefault(case_key(r), {}).setdefault(dev, {})[r["target"]] = r
    kinds = sorted({target_kind(r["target"]) for r in records})
    out = []
    for key, by_dev in groups.items():
        c = CasePP(key, max(_flops(r) for d in by_dev.values() for r in d.values()))
        c.records = by_dev
        for d in devices:
            # a target the bench skipped (not_applicable) did not measure: unknown, not unable
            recs = {lab: r for lab, r in (by_dev.get(d) or {}).items() if not skipped(r)}
            if not recs:
                c.not_measured.append(d)
                continue
            ran = {lab: r for lab, r in recs.items() if r.get("supported")}
            if not ran:  # no target can run it on this device: PP is 0
                c.best[d], c.efficiency[d], c.roofline[d] = None, None, None
                continue
            effs = {lab: r.get("efficiency") for lab, r in ran.items()
                    if r.get("efficiency") is not None}
            if effs:
                lab = max(effs, key=lambda k: effs[k])
                c.best[d], c.efficiency[d] = lab, float(effs[lab])
            else:
                c.no_peer.append(d)
                c.best[d] = None
            roofs = {lab: _roof_frac(r) for lab, r in ran.items() if _roof_frac(r) is not None}
            if roofs:
                c.roofline[d] = max(roofs.values())
                if c.best[d] is None:
                    c.best[d] = max(roofs, key=lambda k: roofs[k])
            else:
                c.no_roof.append(d)
        c.pp_app = metrics.performance_portability(c.efficiency)
        c.pp_roof = metrics.performance_portability(c.roofline)
        for kind in kinds:
            per: dict[str, float | None] = {}
            for d in devices:
                recs = {lab: r for lab, r in (by_dev.get(d) or {}).items()
                        if target_kind(lab) == kind and not skipped(r)}
                if not recs:
                    if d in by_dev:
                        c.kind_missing.setdefault(kind, []).append(d)
                    continue
                ok = [r for r in recs.values() if r.get("supported")]
                if not ok:
                    per[d] = None
                    continue
                effs_k = [float(r["efficiency"]) for r in ok if r.get("efficiency") is not None]
                if effs_k:
                    per[d] = max(effs_k)
            if per:
                c.pp_kind[kind] = metrics.performance_portability(per)
        out.append(c)
    out.sort(key=lambda c: (c.key[0], c.key[1], c.flops, c.key[2]))
    return out


def spread_text(sp: Mapping[str, Any] | None) -> str:
    """' [1.2–1.3]': the IQR of the per-round ratios (empty for older files without it)."""
    if not sp or sp.get("q1") is None or sp.get("q3") is None:
        return ""
    return f" [{fmt_num(sp['q1'], 2)}–{fmt_num(sp['q3'], 2)}]"


def contended_mark(r: Mapping[str, Any]) -> str:
    """' ⚠' for a case that other processes still loaded after it was measured again."""
    return " ⚠" if r.get("contended") else ""


def eff_cell(r: Mapping[str, Any]) -> str:
    """The efficiency against the best peer: the median of the per-round ratios, its IQR,
    and the contention mark."""
    e = r.get("efficiency")
    if e is None:
        return "—"
    return fmt_num(e, 2) + spread_text(r.get("efficiency_spread")) + contended_mark(r)


def target_cell(r: Mapping[str, Any] | None) -> str:
    """One target's numbers on a device: efficiency vs its best peer (median of the per-round
    ratios [IQR]) and % of roof."""
    if r is None:
        return "—"
    if skipped(r):
        return "not measured: not_applicable"
    if not r.get("supported"):
        return "cannot run: " + str((r.get("ours") or {}).get("status"))
    e = r.get("efficiency")
    pct = (r.get("achieved") or {}).get("ours", {}).get("pct_roofline")
    best = r.get("best_peer")
    peer = r["peers"][best]["name"] if best else "no peer"
    return (f"{fmt_num(e, 2)}×{spread_text(r.get('efficiency_spread'))} vs {peer}; "
            f"{fmt_pct(pct)}% roof{contended_mark(r)}")


def kinds_pp_cell(c: CasePP, names: Mapping[str, str]) -> str:
    parts = []
    for kind, pp in sorted(c.pp_kind.items()):
        text = f"{kind} {pp.value:.3g}" if pp.value is not None else f"{kind} n/a"
        if pp.unsupported:
            text += " (cannot run on " + ", ".join(names.get(d, d) for d in pp.unsupported) + ")"
        if c.kind_missing.get(kind):
            text += " (not on " + ", ".join(names.get(d, d) for d in c.kind_missing[kind]) + ")"
        parts.append(text)
    return "; ".join(parts) or "—"


def pp_tables(records: Sequence[Mapping[str, Any]], devices: Sequence[str],
              names: Mapping[str, str]) -> list[str]:
    """Per op: the targets of each device side by side, the best one, and PP over devices."""
    cases = portability(records, devices)
    by_op: dict[str, list[CasePP]] = {}
    for c in cases:
        by_op.setdefault(c.key[0], []).append(c)
    lines: list[str] = []
    for op, cs in by_op.items():
        cols: list[tuple[str, str]] = []  # (device, target label) present for this op
        impl = {(str(r.get("device_key") or r.get("platform", "?")), r["target"]):
                r.get("implementation") for r in records}
        for d in devices:
            labs = sorted({lab for c in cs for lab in (c.records.get(d) or {})},
                          key=lambda lab: (target_kind(lab), lab))
            cols += [(d, lab) for lab in labs]
        header = (["dtype", "size"] + [f"{names.get(d, d)} {target_title(lab, impl.get((d, lab)))}"
                                       for d, lab in cols]
                  + ["best per device", "PP best (vs peers)", "PP best (roofline)",
                     "PP per target kind (vs peers)"])
        rows = []
        for c in cs:
            cells = [c.key[1], c.key[2]]
            cells += [target_cell((c.records.get(d) or {}).get(lab)) if d in c.records
                      else "not measured" for d, lab in cols]
            bests = []
            for d in devices:
                if d in c.best:
                    bests.append(f"{names.get(d, d)}: {c.best[d] or 'none'}")
            cells += ["; ".join(bests) or "—",
                      pp_cell(c.pp_app, c.no_peer, names, c.not_measured),
                      pp_cell(c.pp_roof, c.no_roof, names, c.not_measured),
                      kinds_pp_cell(c, names)]
            rows.append(cells)
        lines += ["", f"### {op}", "", md_table(header, rows)]
    return lines


def pp_cell(pp: metrics.Portability | None, excluded: Sequence[str], names: Mapping[str, str],
            not_measured: Sequence[str] = ()) -> str:
    """PP with the reason it is what it is: who cannot run it, who is left out and why."""
    if pp is None or pp.value is None:
        return "n/a" + (" (no platform has data)" if not pp or not pp.platforms else "")
    text = f"{pp.value:.3g}"
    notes = []
    if pp.unsupported:
        notes.append("cannot run on " + ", ".join(names.get(p, p) for p in pp.unsupported))
    elif excluded:
        notes.append("without " + ", ".join(names.get(p, p) for p in excluded))
    if not_measured:
        notes.append(", ".join(names.get(p, p) for p in not_measured) + " not measured")
    return text + (f" ({'; '.join(notes)})" if notes else "")


# --- one run --------------------------------------------------------------------------------------
def _peers_cell(rec: Mapping[str, Any]) -> str:
    parts = []
    for k, m in rec.get("peers", {}).items():
        name = m.get("name", k)
        if m.get("status") == "ok":
            parts.append(f"{name} {fmt_time(m.get('median_s'))}")
        else:
            parts.append(f"{name}: {m.get('status')}")
    return "; ".join(parts) or "none applicable"


def _mem_cell(rec: Mapping[str, Any]) -> str:
    mem = rec.get("memory")
    if not mem:
        return ""
    fused = mem.get("fused", {}).get("extra_bytes")
    unf = mem.get("unfused", {}).get("extra_bytes")
    return f"{fmt_bytes(fused)} / {fmt_bytes(unf)}"


def _busy_cell(rec: Mapping[str, Any]) -> str:
    """Others' share of the CPUs while the case ran; when it was measured again, the first
    attempt's share too; ⚠ when even the attempt kept exceeds ``CONTENTION_NOTE``."""
    c = rec.get("contention") or {}
    share = c.get("other_share")
    if share is None:
        return "—"
    text = f"{100 * share:.0f}%"
    again = rec.get("remeasured") or {}
    firsts = [a.get("other_share") for a in again.get("attempts") or []]
    if len(firsts) > 1:
        text += (" (measured " + str(len(firsts)) + "×: "
                 + " / ".join("—" if f is None else f"{100 * f:.0f}%" for f in firsts) + ")")
    if c.get("hog_share") is not None:
        text += f", hog {100 * c['hog_share']:.0f}%"
    return text + contended_mark(rec)


def run_markdown(result: Mapping[str, Any]) -> str:
    """The table printed at the end of `portakern bench` (also REPORT-ready markdown)."""
    env = result.get("environment", {})
    lines = [f"## portakern bench — {env.get('hostname', '?')} "
             f"({env.get('cpu', {}).get('model', '?')}), suite {result['config']['suite']}"
             + (" — INTERRUPTED (partial)" if result.get("interrupted") else "")]
    lines += warnings_markdown(result.get("peers_missing") or {})
    trows = []
    for label, t in result.get("targets", {}).items():
        own = t.get("roofline", {})
        used = t.get("roofline_effective") or own
        src = used.get("sources", {})

        def num(v: float | None, key: str, src: Mapping[str, str] = src,
                label: str = label) -> str:
            text = fmt_num(v, 4)
            return text + (f" (from {src[key]})" if src.get(key, label) != label else "")

        peaks = ", ".join(f"{k} {fmt_num(v, 4)}" for k, v in (own.get("fma_gflops") or {}).items())
        upeaks = ", ".join(f"{k} {num(v, 'fma_gflops.' + k)}"
                           for k, v in (used.get("fma_gflops") or {}).items())
        trows.append([target_title(label, metrics.implementation_of(label, t)),
                      t["device"]["name"],
                      fmt_num(own.get("copy_gbs"), 4) if own.get("status") == "ok"
                      else own.get("status", "—"),
                      peaks or own.get("reason", "—")[:120],
                      num(used.get("copy_gbs"), "copy_gbs"), upeaks or "—"])
    for name, why in result.get("targets_unavailable", {}).items():
        trows.append([name, "unavailable", "—", why[:120], "—", "—"])
    lines += ["", md_table(["target", "device", "copy GB/s (own probe)",
                            "FMA GFLOP/s (own probe)", "roof used: GB/s",
                            "roof used: GFLOP/s"], trows)]
    for op, why in (result.get("ops_without_sizes") or {}).items():
        lines += ["", f"Op {op} not benchmarked: {_cell(why)}"]
    rows = []
    cases = sorted(result.get("cases", []), key=lambda r: (r["op"], r["dtype"], _flops(r),
                                                           r["label"], r["target"]))
    for r in cases:
        ach = r.get("achieved", {}).get("ours", {})
        ours = r.get("ours", {})
        best = r.get("best_peer")
        best_name = r["peers"][best]["name"] if best else "—"
        unf = r.get("unfused")
        unf_cell = timing_cell(unf) if unf else ""
        ur = r.get("unfused_ratio")
        if ur and unf and unf.get("status") == "ok":
            unf_cell += f" = {ur['median']:.2g}x ours{spread_text(ur)}"
        elif unf and unf.get("status") == "ok" and ours.get("median_s"):
            unf_cell += f" = {unf['median_s'] / ours['median_s']:.2g}x ours"
        first = ours.get("first_call_s")
        info = ours.get("info") or {}
        comp = info.get("compile_s")
        first_cell = fmt_time(first)
        if info.get("compile_cached"):
            first_cell += " (kernel built by an earlier case)"
        elif comp is not None:
            first_cell += f" (compile {fmt_time(comp)})"
        if ours.get("status") != "ok":
            first_cell = ours.get("reason", "")[:80]
        rows.append([r["op"], r["dtype"], r["label"],
                     target_title(r["target"], r.get("implementation")
                                  or metrics.implementation_of(
                                      r["target"], (result.get("targets") or {}).get(
                                          r["target"]))),
                     timing_cell(ours), first_cell,
                     fmt_num(ach.get("gflops")), fmt_num(ach.get("gbs")),
                     fmt_pct(ach.get("pct_roofline")), _peers_cell(r), best_name,
                     eff_cell(r), unf_cell, _mem_cell(r),
                     _busy_cell(r)])
    lines += ["", md_table(["op", "dtype", "size", "target", "ours (median ±IQR/2)",
                            "first call", "GFLOP/s", "GB/s", "% roof", "peers (median)",
                            "best peer", "eff (peer/ours): median of per-round ratios [IQR]",
                            "unfused chain", "extra mem fused / unfused", "others' CPU"], rows)]
    lines += contention_lines(cases)
    lines += hog_lines(result.get("hog"))
    lines += dispatch_markdown(result.get("dispatch") or {})
    attach_devices(result)
    host, model = env.get("hostname", "?"), cpu_model_of(result)
    devs = list(dict.fromkeys(device_key_of(t, host, model)
                              for t in result.get("targets", {}).values()))
    if devs:
        names = {d: f"D{i + 1}" for i, d in enumerate(devs)}
        legend = ", ".join(f"{names[d]} = {d}" for d in devs)
        lines += ["", f"Performance portability over this run's {len(devs)} device(s) "
                  f"({legend}); the targets on one device side by side, PP over devices "
                  "(docs/bench.md):"]
        lines += pp_tables(result.get("cases", []), devs, names)
        lines += silicon_lines(result.get("cases", []), devs, names, roofs=roof_lines(
            result.get("targets") or {}, devs, names, host, model))
    if result.get("wall_s") is not None:
        lines += ["", f"wall time {result['wall_s']:.1f} s"]
    return "\n".join(lines) + "\n"


# --- the implementations on the same silicon (implementations.py) ----------------------------
def member_cell(m: Member | None) -> str:
    """'2.02 ms · eff 0.69 · 59% roof' (the target that gave it where the member has several;
    ⚠ if that measurement was contended)."""
    if m is None:
        return "—"
    if m.status != "ok":
        return m.status + (f" ({m.reason})" if m.reason else "")
    text = (f"{fmt_time(m.time_s)} · eff {fmt_num(m.efficiency, 2)} · "
            f"{fmt_pct(None if m.roof is None else 100 * m.roof)}% roof")
    if m.source:
        text += f" ({m.source})"
    return text + (" ⚠" if m.contended else "")


def peer_cell(m: Member | None) -> str:
    if m is None:
        return "—"
    if m.status != "ok":
        return m.status + (f" ({m.reason[:80]})" if m.reason else "")
    return f"{fmt_time(m.time_s)} · eff {fmt_num(m.efficiency, 2)}" + (" ⚠" if m.contended
                                                                        else "")


def silicon_pp_cell(pp: metrics.Portability | None, c: SiliconCase,
                    excluded: Sequence[str]) -> str:
    if pp is None or pp.value is None:
        return "n/a"
    notes = []
    if pp.unsupported:
        notes.append("cannot run: " + ", ".join(pp.unsupported))
    if c.not_measured:
        notes.append("not measured: " + ", ".join(c.not_measured))
    if excluded and not pp.unsupported:
        notes.append("without " + ", ".join(excluded))
    return f"{pp.value:.3g}" + (f" ({'; '.join(notes)})" if notes else "")


def member_title(name: str, records: Sequence[Mapping[str, Any]], device: str) -> str:
    """A column header: the member and the targets behind it ('opencl:pocl (opencl:0)')."""
    if name == NUMPY_MEMBER and not any(member_of(r) == name for r in records):
        return "numpy (peer)"
    labels = sorted({str(r.get("target")) for r in records
                     if device_of(r) == device and member_of(r) == name})
    return f"{name} ({', '.join(labels)})" if labels and labels != [name] else name


def silicon_tables(records: Sequence[Mapping[str, Any]], devices: Sequence[str],
                   names: Mapping[str, str], level: str = "###") -> list[str]:
    """Markdown: per device with two or more implementations and per op, one row per case:
    each member's time, efficiency and % roof, the other peers, the fastest, PP over H."""
    cases = silicon_cases(records, devices)
    lines: list[str] = []
    by: dict[tuple[str, str], list[SiliconCase]] = {}
    for c in cases:
        by.setdefault((c.device, c.key[0]), []).append(c)
    for (d, op), cs in by.items():
        h = members(records, d)
        peer_keys: list[str] = []
        peer_names: dict[str, str] = {}
        for c in cs:
            for k, m in c.peers.items():
                if k not in peer_keys:
                    peer_keys.append(k)
                    peer_names[k] = m.name
        header = (["dtype", "size"] + [member_title(n, records, d) for n in h]
                  + [f"{peer_names[k]} (peer)" for k in peer_keys]
                  + ["fastest", "PP over H (vs fastest)", "PP over H (roofline)"])
        rows = []
        for c in cs:
            rows.append([c.key[1], c.key[2]] + [member_cell(c.members.get(n)) for n in h]
                        + [peer_cell(c.peers.get(k)) for k in peer_keys]
                        + [f"{c.fastest} {fmt_time(c.fastest_s)}" if c.fastest else "—",
                           silicon_pp_cell(c.pp_app, c, ()),
                           silicon_pp_cell(c.pp_roof, c, c.no_roof)])
        lines += ["", f"{level} {op} on {names.get(d, d)}: implementations side by side", "",
                  md_table(header, rows)]
    return lines


def silicon_lines(records: Sequence[Mapping[str, Any]], devices: Sequence[str],
                  names: Mapping[str, str], level: str = "###",
                  roofs: Mapping[str, str] | None = None) -> list[str]:
    """The implementations-on-the-same-silicon tables (implementations.py) under their
    paragraph; empty when no device has two implementations."""
    tables = silicon_tables(records, devices, names, level)
    if not tables:
        return []
    sets = "; ".join(f"{names.get(d, d)}: {{{', '.join(members(records, d))}}}"
                     + (f", {roofs[d]}" if roofs and roofs.get(d) else "")
                     for d in devices if len(members(records, d)) > 1)
    return ["", "**The portability gap between implementations on the same silicon.** Per "
            "device, each implementation (portakern's per OpenCL runtime, jax at the faster "
            "of its lowerings, the numpy peer) beside the others and the remaining peers: "
            "efficiency = the fastest time among all of them on the device / its time, % roof "
            "against the device's one roof, PP = harmonic mean over H, 0 if one cannot run "
            f"the case (docs/bench.md). H per device: {sets}."] + tables


def roof_lines(targets: Mapping[str, Mapping[str, Any]], devices: Sequence[str],
               names: Mapping[str, str], host: str, cpu_model: str | None = None
               ) -> dict[str, str]:
    """Per device: its one roof, and which target's probe or which measurement set each
    number ('roof 105 GB/s (from jax:0), float32 224 GFLOP/s (from opencl:1)')."""
    out: dict[str, str] = {}
    for d in devices:
        on = [(lab, t) for lab, t in targets.items()
              if device_key_of(t, host, cpu_model) == d]
        if not on:
            continue
        roof = on[0][1].get("roofline_effective") or {}
        if roof.get("status") != "ok":
            continue
        src = roof.get("sources") or {}
        parts = [f"{fmt_num(roof.get('copy_gbs'), 4)} GB/s"
                 + (f" (from {src['copy_gbs']})" if src.get("copy_gbs") else "")]
        parts += [f"{k} {fmt_num(v, 4)} GFLOP/s"
                  + (f" (from {src['fma_gflops.' + k]})" if src.get("fma_gflops." + k) else "")
                  for k, v in (roof.get("fma_gflops") or {}).items()]
        out[d] = "one roof: " + ", ".join(parts)
    return out


def contention_lines(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """The note under the run table: cases measured again, and those still contended."""
    again = [r for r in cases if r.get("remeasured")]
    still = [r for r in cases if r.get("contended")]
    busy = [r for r in cases if (r.get("contention") or {}).get("other_share") is not None
            and r["contention"]["other_share"] > CONTENTION_NOTE]
    if not (again or busy):
        return []
    text = (f"Contention: {len(again)} of {len(cases)} measurements ran while other processes "
            f"used more than {CONTENTION_NOTE:.0%} of the CPUs and were measured again (the "
            "least contended attempt is kept; column \"others' CPU\" gives each attempt's "
            "share).")
    if still or busy:
        worst = max((r["contention"]["other_share"] for r in busy), default=0.0)
        which = ("" if len(still) > 8 else ": " + "; ".join(
            f"{r['id']} on {r['target']}" for r in still))
        text += (f" **⚠ {len(still)} still exceeded it** (up to {worst:.0%}){which}. Their "
                 "absolute times are suspect; their ratios, medians of interleaved rounds, "
                 "less so, but a steady load can slow one implementation more than another.")
    return ["", text]


def hog_lines(hog: Mapping[str, Any] | None) -> list[str]:
    """The quiet-versus-hogged table of a `--hog` run (empty otherwise)."""
    if not hog:
        return []
    rows = []
    for c in hog.get("comparison") or []:
        q, h = c["quiet"], c["hogged"]
        d = c.get("diff_pct")
        rows.append([c["op"], c["label"], c["target"], c["name"] + (" (best)" if c.get(
            "best_peer") else ""), f"{fmt_num(q['median'], 3)}{spread_text(q)}",
            f"{fmt_num(h['median'], 3)}{spread_text(h)}",
            "—" if d is None else f"{d:+.1f}%", "yes" if c.get("within_10pct") else "**no**",
            _share(c.get("quiet_other_share")), _share(c.get("hogged_other_share")),
            _share(c.get("hog_share"))])
    n_ok = sum(1 for c in hog.get("comparison") or [] if c.get("within_10pct"))
    return ["", f"Load stability (`--hog`): every case measured quiet, then with a busy loop "
            f"pinned to core {hog.get('core')}; each ratio (peer / ours, median of the "
            f"per-round ratios [IQR]) quiet and hogged. Within 10% of the quiet ratio: "
            f"{n_ok} of {len(rows)}.", "",
            md_table(["op", "size", "target", "ratio of", "quiet", "hogged", "difference",
                      "within 10%", "others' CPU: quiet", "others' CPU: hogged",
                      "hog's CPU share"], rows)]


def _share(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def _us_spread(m: Mapping[str, float]) -> str:
    """'12.3 µs ±4%': a median in microseconds and half its IQR relative to it."""
    med = m["median"]
    text = f"{med:.3g} µs"
    return text + (f" ±{100 * (m['q3'] - m['q1']) / 2 / med:.0f}%" if med > 0 else "")


# the implementations with a host-overhead column, and their short names in the table
HOST_COLUMNS = {"call": "call", "call_out": "out=", "call_backend": "backend=",
                "call_use": "pk.use"}


def dispatch_markdown(dispatch: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Lines of the dispatch-overhead table (one row per target and entry point; empty when
    not measured). Each overhead cell holds the host figure and the wall figure side by side,
    ``host / wall``, so the number the target is judged on is never read without the other."""
    from .dispatch import TARGET_US, entries_of

    if not dispatch:
        return []
    rows = []
    head = None
    ncols = len(HOST_COLUMNS) + 2
    for target, rec in dispatch.items():
        for name, d in entries_of(rec).items():
            if d.get("status") != "ok":
                rows.append([target, name, d.get("status", "?"), *[""] * (ncols - 1),
                             _cell(str(d.get("reason", ""))[:100])])
                continue
            head = head or d
            pc, ov, ok = d["per_call_us"], d["overhead_us"], d["meets_target"]
            host = d.get("host") or {}
            hov = host.get("overhead_us") or {}

            def pair(v: str, hov: Mapping[str, float] = hov, ov: Mapping[str, float] = ov
                     ) -> str:
                if v not in hov and v not in ov:
                    return "n/a"
                h = f"{hov[v]:+.3g}" if v in hov else "n/a"
                w = f"{ov[v]:+.3g}" if v in ov else "n/a"
                return f"{h} / {w} µs"

            raw = (_us_spread(host["per_call_us"]["raw"]) if host.get("per_call_us") else "n/a")
            judged = "host" if d.get("judged_on", "wall") == "host" else "wall"
            within = ", ".join(f"{HOST_COLUMNS[v]} {'yes' if ok[v] else 'no'}"
                               for v in HOST_COLUMNS if v in ok)
            rows.append([target, d.get("call", name), *(pair(v) for v in HOST_COLUMNS),
                         f"{raw} / {_us_spread(pc['raw'])}", _us_spread(pc["call"]),
                         f"{within} (judged on {judged})"])
    bound = (head or {}).get("target_us", TARGET_US)
    what = (f"{head.get('dtype', '')}, device-resident, {head['iterations']} calls per block, "
            f"median of {head['rounds']} interleaved rounds" if head else "")
    return ["", f"Dispatch overhead of the calls users write ({what}; target: each adds at "
            f"most {bound:g} µs over the raw enqueue of the same compiled kernels, whose scalar "
            "arguments are bound once, as the plan's are). Every overhead cell is **host / "
            "wall**. **Host**: the calls enqueued while the device queue is held, only the "
            "host's side timed (portakern's own cost; the target is judged on it). **Wall**: "
            "the calls plus one synchronize per block, device work included; on a CPU device "
            "its worker threads share the host's cores and amplify host time (docs/bench.md). "
            "Columns: the call as written (backend picked from the inputs), with `out=`, with "
            "`backend=` and inside `pk.use(...)`:", "",
            md_table(["target", "call", "overhead: call (host / wall)",
                      "overhead: out= (host / wall)", "overhead: backend= (host / wall)",
                      "overhead: pk.use (host / wall)", "raw enqueue per call (host / wall)",
                      "wall per call", f"within {bound:g} µs"], rows)]


def warnings_markdown(missing: Mapping[str, str]) -> list[str]:
    """The missing-peer warning printed at the top of a run's table and of the report."""
    if not missing:
        return []
    return ["", "> **WARNING: promised peers are missing, so their columns are empty:** "
            + "; ".join(f"{k}: {_cell(v)}" for k, v in missing.items()), ""]


# --- many runs ------------------------------------------------------------------------------------
@dataclass
class Merged:
    platforms: list[str]
    short: dict[str, str]  # platform -> P1, P2, ...
    records: list[dict[str, Any]]
    sources: list[dict[str, Any]]
    notes: list[str]
    devices: list[str] = field(default_factory=list)  # physical devices, in file order
    device_short: dict[str, str] = field(default_factory=dict)  # device -> D1, D2, ...
    device_label: dict[str, str] = field(default_factory=dict)  # device -> model @ host
    missing_peers: dict[str, str] = field(default_factory=dict)  # "host (model): peer" -> why


def platform_on(platform: str, device: str) -> str:
    """A platform's identity across files: its stored name with its device key. The name
    alone ('jax:0 · cpu @ vm': jax calls every CPU 'cpu') is the same for two machines behind
    one hostname, and the newer file's cases would replace the other machine's as if they
    were measured again."""
    return f"{platform} [{device}]"


def merge(results: Sequence[Mapping[str, Any]]) -> Merged:
    """Line up the cases of several result files; newer files win on a repeated platform."""
    order = sorted(results, key=lambda r: r.get("environment", {}).get("created", ""))
    by_plat_case: dict[tuple[str, tuple[str, str, str]], dict[str, Any]] = {}
    platforms: list[str] = []
    notes: list[str] = []
    sources = []
    devices: list[str] = []
    device_label: dict[str, str] = {}
    missing: dict[str, str] = {}
    for res in order:
        attach_devices(res)
        host = res.get("environment", {}).get("hostname") or "?"
        model = cpu_model_of(res)  # a hostname is not a machine: the CPU model tells them apart
        for t in res.get("targets", {}).values():
            d = device_key_of(t, host, model)
            if d not in devices:
                devices.append(d)
            kind = (t.get("device") or {}).get("kind")
            device_label[d] = (f"{model or 'CPU'} @ {host}" if kind == "cpu" else
                               f"{(t.get('device') or {}).get('name', '?')} @ {host}")
        for k, why in (res.get("peers_missing") or {}).items():
            missing[f"{host} ({model}): {k}" if model else f"{host}: {k}"] = why
        src = {"path": res.get("_path"), "host": res.get("environment", {}).get("hostname"),
               "cpu_model": model, "created": res.get("environment", {}).get("created"),
               "commit": (res.get("environment", {}).get("git") or {}).get("commit"),
               "suite": res.get("config", {}).get("suite"),
               "interrupted": res.get("interrupted", False), "targets": {}}
        for label, t in res.get("targets", {}).items():
            src["targets"][label] = t
            plat = platform_on(t["platform"], device_key_of(t, host, model))
            if plat not in platforms:
                platforms.append(plat)
        for rec in res.get("cases", []):
            plat = platform_on(rec["platform"], rec["device_key"])
            k = (plat, case_key(rec))
            if k in by_plat_case:
                notes.append(f"{rec['id']} on {plat}: measured again in "
                             f"{src['path']}; the newer measurement is used")
            by_plat_case[k] = dict(rec)
        sources.append(src)
    short = {p: f"P{i + 1}" for i, p in enumerate(platforms)}
    return Merged(platforms, short, list(by_plat_case.values()), sources, notes, devices,
                  {d: f"D{i + 1}" for i, d in enumerate(devices)}, device_label, missing)


def report_markdown(m: Merged, plot_files: Sequence[str] = ()) -> str:
    lines = ["# portakern: the portability gap", ""]
    lines += warnings_markdown(m.missing_peers)
    lines += ["Efficiency = best native peer's time / portakern's time on the same device "
              "(1 = parity, >1 = faster than the peer). PP = Pennycook's performance "
              "portability over **devices** (harmonic mean, 0 if a device cannot run the "
              "case): the best portakern target per device, and per target kind. Targets "
              "sharing a device are shown side by side, not averaged. % roof is against the "
              "device's roof: the best of our probes and every rate measured on it in the run, "
              "so it never exceeds 100. Per device, the implementations on the same silicon "
              "(PoCL and Intel's OpenCL on one CPU, jax, numpy) follow side by side, with PP "
              "over them. See docs/bench.md.", "", "## Devices", ""]
    latest: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {}
    device_of_plat: dict[str, str] = {}
    files: dict[str, list[str]] = {}
    for src in m.sources:  # oldest first: the newest file's record of a platform wins
        for label, t in src["targets"].items():
            d = device_key_of(t, src["host"] or "?", src.get("cpu_model"))
            plat = platform_on(t["platform"], d)
            latest[plat], device_of_plat[plat] = (src, t, label), d
            files.setdefault(plat, []).append(
                Path(src["path"] or "?").name + (" (interrupted)" if src["interrupted"] else ""))
    drow = []
    for d in m.devices:
        plats = [p for p in m.platforms if device_of_plat[p] == d]
        src, t, _ = latest[plats[-1]]
        roof = t.get("roofline_effective") or t.get("roofline", {})
        peaks = ", ".join(f"{k} {fmt_num(v, 4)}" for k, v in
                          (roof.get("fma_gflops") or {}).items())
        probe = t.get("roofline_probes") or {}
        ppeaks = ", ".join(f"{k} {fmt_num(v, 4)}" for k, v in
                           (probe.get("fma_gflops") or {}).items())
        drow.append([m.device_short[d], m.device_label.get(d, d),
                     ", ".join(target_title(latest[p][2], metrics.implementation_of(
                         latest[p][2], latest[p][1])) for p in plats),
                     fmt_num(roof.get("copy_gbs"), 4), peaks or roof.get("status", "—"),
                     (f"{fmt_num(probe.get('copy_gbs'), 4)} GB/s, {ppeaks}" if probe else "—"),
                     (src["commit"] or "?")[:10], str(src["suite"]),
                     ", ".join(sorted({f for p in plats for f in files[p]}))])
    lines.append(md_table(["id", "device", "targets", "roof GB/s", "roof GFLOP/s",
                           "of which the probes", "commit (newest)", "suite", "files"], drow))
    lines += pp_tables(m.records, m.devices, m.device_short)
    silicon = silicon_lines(m.records, m.devices, m.device_short, level="###")
    if silicon:
        lines += ["", "## Implementations on the same silicon"] + silicon
    if plot_files:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(f).stem}]({f})" for f in plot_files]
    if m.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in m.notes]
    return "\n".join(lines) + "\n"


def write_report(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str],
                 plots: bool = True) -> Path:
    """Merge result files into out_dir/REPORT.md (+ out_dir/plots/*.png)."""
    if not paths:
        raise ValueError("portakern report needs at least one result file; expected e.g. "
                         "`portakern report benchmarks/results/*.json`.")
    results = [load(p) for p in paths]
    merged = merge(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    if plots:
        from .plots import plot_report

        files = [os.path.relpath(f, out) for f in plot_report(merged, out / "plots")]
    path = out / "REPORT.md"
    path.write_text(report_markdown(merged, files))
    return path

"""Tables and the fleet report: one run's markdown, and `portakern report` over many runs.

A *platform* (the unit of Pennycook's PP) is one backend target on one device of one machine:
``opencl:0 · <device> @ <host>``. Each result file contributes its targets as platforms; the
report lines up the same case (op, dtype, size, parameters) across all of them. For each case:

- efficiency on a platform = best peer time / our time there (None: no peer could run there);
- PP (vs peers) = harmonic mean of those efficiencies, 0 if any platform cannot run the case;
- PP (roofline) = the same over % of roofline / 100 (architectural efficiency), which exists
  even where no vendor peer does.

A platform that did not measure a case at all (another suite, an interrupted run) is listed as
"not measured" and left out of that case's PP: it is unknown, not unsupported.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import metrics

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


# --- portability over platforms -----------------------------------------------------------------
@dataclass
class CasePP:
    key: tuple[str, str, str]
    flops: float
    efficiency: dict[str, float | None] = field(default_factory=dict)  # None = cannot run
    roofline: dict[str, float | None] = field(default_factory=dict)
    no_peer: list[str] = field(default_factory=list)
    no_roof: list[str] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)
    pp_app: metrics.Portability | None = None
    pp_roof: metrics.Portability | None = None


def portability(records: Sequence[Mapping[str, Any]], platforms: Sequence[str]
                ) -> list[CasePP]:
    """Per case: each platform's efficiencies and the PP over ``platforms``."""
    groups: dict[tuple[str, str, str], dict[str, Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault(case_key(r), {})[r["platform"]] = r
    out = []
    for key, by_plat in groups.items():
        c = CasePP(key, max(_flops(r) for r in by_plat.values()))
        for p in platforms:
            r = by_plat.get(p)
            if r is None:
                c.not_measured.append(p)
                continue
            if not r.get("supported"):
                c.efficiency[p] = None
                c.roofline[p] = None
                continue
            e = r.get("efficiency")
            if e is None:
                c.no_peer.append(p)
            else:
                c.efficiency[p] = float(e)
            pct = (r.get("achieved") or {}).get("ours", {}).get("pct_roofline")
            if pct is None:
                c.no_roof.append(p)
            else:
                c.roofline[p] = float(pct) / 100.0
        c.pp_app = metrics.performance_portability(c.efficiency)
        c.pp_roof = metrics.performance_portability(c.roofline)
        out.append(c)
    out.sort(key=lambda c: (c.key[0], c.key[1], c.flops, c.key[2]))
    return out


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
    c = rec.get("contention") or {}
    share = c.get("other_share")
    return "—" if share is None else f"{100 * share:.0f}%"


def run_markdown(result: Mapping[str, Any]) -> str:
    """The table printed at the end of `portakern bench` (also REPORT-ready markdown)."""
    env = result.get("environment", {})
    lines = [f"## portakern bench — {env.get('hostname', '?')} "
             f"({env.get('cpu', {}).get('model', '?')}), suite {result['config']['suite']}"
             + (" — INTERRUPTED (partial)" if result.get("interrupted") else "")]
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
        trows.append([label, t["device"]["name"],
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
        eff = r.get("efficiency")
        best = r.get("best_peer")
        best_name = r["peers"][best]["name"] if best else "—"
        unf = r.get("unfused")
        unf_cell = timing_cell(unf) if unf else ""
        if unf and unf.get("status") == "ok" and ours.get("median_s"):
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
        rows.append([r["op"], r["dtype"], r["label"], r["target"], timing_cell(ours), first_cell,
                     fmt_num(ach.get("gflops")), fmt_num(ach.get("gbs")),
                     fmt_pct(ach.get("pct_roofline")), _peers_cell(r), best_name,
                     fmt_num(eff, 2), unf_cell, _mem_cell(r), _busy_cell(r)])
    lines += ["", md_table(["op", "dtype", "size", "target", "ours (median ±IQR/2)",
                            "first call", "GFLOP/s", "GB/s", "% roof", "peers (median)",
                            "best peer", "eff (peer/ours)", "unfused chain",
                            "extra mem fused / unfused", "others' CPU"], rows)]
    busy = [(r, r["contention"]) for r in cases if (r.get("contention") or {}).get(
        "other_share", 0) > CONTENTION_NOTE]
    if busy:
        worst = max(c["other_share"] for _, c in busy)
        which = ("" if len(busy) > 6 else ": " + "; ".join(
            f"{r['id']} on {r['target']}" for r, _ in busy))
        lines += ["", f"Contention: {len(busy)} of {len(cases)} measurements ran while other "
                  f"processes used more than {CONTENTION_NOTE:.0%} of the CPUs (up to "
                  f"{worst:.0%}; column \"others' CPU\"). Their absolute times are suspect; "
                  f"ratios, measured back to back, less so{which}."]
    lines += dispatch_markdown(result.get("dispatch") or {})
    plats = [t["platform"] for t in result.get("targets", {}).values()]
    if plats:
        names = {t["platform"]: lab for lab, t in result.get("targets", {}).items()}
        prow = []
        for c in portability(result.get("cases", []), plats):
            prow.append([c.key[0], c.key[1], c.key[2], pp_cell(c.pp_app, c.no_peer, names),
                         pp_cell(c.pp_roof, c.no_roof, names),
                         ", ".join(names.get(p, p) for p in c.not_measured) or ""])
        lines += ["", f"Performance portability over this run's {len(plats)} platform(s):", "",
                  md_table(["op", "dtype", "size", "PP (vs peers)", "PP (roofline)",
                            "not measured"], prow)]
    if result.get("wall_s") is not None:
        lines += ["", f"wall time {result['wall_s']:.1f} s"]
    return "\n".join(lines) + "\n"


def _us_spread(m: Mapping[str, float]) -> str:
    """'12.3 µs ±4%': a median in microseconds and half its IQR relative to it."""
    med = m["median"]
    text = f"{med:.3g} µs"
    return text + (f" ±{100 * (m['q3'] - m['q1']) / 2 / med:.0f}%" if med > 0 else "")


def dispatch_markdown(dispatch: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Lines of the dispatch-overhead table (one row per target; empty when not measured)."""
    if not dispatch:
        return []
    rows = []
    head = None
    for target, d in dispatch.items():
        if d.get("status") != "ok":
            rows.append([target, d.get("status", "?"), "", "", "", "",
                         _cell(str(d.get("reason", ""))[:100])])
            continue
        head = head or d
        pc, ov, ok = d["per_call_us"], d["overhead_us"], d["meets_target"]
        rows.append([target, _us_spread(pc["call"]), _us_spread(pc["call_out"]),
                     _us_spread(pc["raw"]),
                     f"{ov['call']:+.3g} µs", f"{ov['call_out']:+.3g} µs",
                     f"call {'yes' if ok['call'] else 'no'}, out= "
                     f"{'yes' if ok['call_out'] else 'no'}"])
    bound = (head or {}).get("target_us", 10.0)
    what = (f"{head['op']} {'x'.join(map(str, head['shape']))} {head['dtype']}, "
            f"device-resident, {head['iterations']} calls per block + one synchronize, median of "
            f"{head['rounds']} interleaved rounds" if head else "")
    return ["", f"Dispatch overhead ({what}; target: a call adds at most {bound:g} µs over the "
            "raw enqueue of the same compiled kernel):", "",
            md_table(["target", "pk.call per call", "pk.call(out=) per call",
                      "raw enqueue per call", "overhead pk.call", "overhead out=",
                      f"within {bound:g} µs"], rows)]


# --- many runs ------------------------------------------------------------------------------------
@dataclass
class Merged:
    platforms: list[str]
    short: dict[str, str]  # platform -> P1, P2, ...
    records: list[dict[str, Any]]
    sources: list[dict[str, Any]]
    notes: list[str]


def merge(results: Sequence[Mapping[str, Any]]) -> Merged:
    """Line up the cases of several result files; newer files win on a repeated platform."""
    order = sorted(results, key=lambda r: r.get("environment", {}).get("created", ""))
    by_plat_case: dict[tuple[str, tuple[str, str, str]], dict[str, Any]] = {}
    platforms: list[str] = []
    notes: list[str] = []
    sources = []
    for res in order:
        src = {"path": res.get("_path"), "host": res.get("environment", {}).get("hostname"),
               "created": res.get("environment", {}).get("created"),
               "commit": (res.get("environment", {}).get("git") or {}).get("commit"),
               "suite": res.get("config", {}).get("suite"),
               "interrupted": res.get("interrupted", False), "targets": {}}
        for label, t in res.get("targets", {}).items():
            src["targets"][label] = t
            if t["platform"] not in platforms:
                platforms.append(t["platform"])
        for rec in res.get("cases", []):
            k = (rec["platform"], case_key(rec))
            if k in by_plat_case:
                notes.append(f"{rec['id']} on {rec['platform']}: measured again in "
                             f"{src['path']}; the newer measurement is used")
            by_plat_case[k] = dict(rec)
        sources.append(src)
    short = {p: f"P{i + 1}" for i, p in enumerate(platforms)}
    return Merged(platforms, short, list(by_plat_case.values()), sources, notes)


def report_markdown(m: Merged, plot_files: Sequence[str] = ()) -> str:
    lines = ["# portakern: the portability gap", "",
             "Efficiency = best native peer's time / portakern's time on the same device "
             "(1 = parity, >1 = faster than the peer). PP = Pennycook's performance "
             "portability: harmonic mean over the platforms, 0 if any cannot run the case. "
             "See docs/bench.md.", "", "## Platforms", ""]
    latest: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {}
    files: dict[str, list[str]] = {}
    for src in m.sources:  # oldest first: the newest file's record of a platform wins
        for label, t in src["targets"].items():
            latest[t["platform"]] = (src, t, label)
            files.setdefault(t["platform"], []).append(
                Path(src["path"] or "?").name + (" (interrupted)" if src["interrupted"] else ""))
    prow = []
    for p in m.platforms:
        src, t, label = latest[p]
        roof = t.get("roofline_effective") or t.get("roofline", {})
        peaks = ", ".join(f"{k} {fmt_num(v, 4)}" for k, v in
                          (roof.get("fma_gflops") or {}).items())
        prow.append([m.short[p], label, t["device"]["name"], src["host"] or "?",
                     fmt_num(roof.get("copy_gbs"), 4), peaks or roof.get("status", "—"),
                     (src["commit"] or "?")[:10], str(src["suite"]), ", ".join(files[p])])
    lines.append(md_table(["id", "target", "device", "host", "roof GB/s", "roof GFLOP/s",
                           "commit (newest)", "suite", "files"], prow))
    cases = portability(m.records, m.platforms)
    by_op: dict[str, list[CasePP]] = {}
    for c in cases:
        by_op.setdefault(c.key[0], []).append(c)
    rec_index = {(r["platform"], case_key(r)): r for r in m.records}
    for op, cs in by_op.items():
        lines += ["", f"## {op}", ""]
        header = ["dtype", "size"] + [m.short[p] for p in m.platforms] + ["PP (vs peers)",
                                                                           "PP (roofline)"]
        rows = []
        for c in cs:
            cells = [c.key[1], c.key[2]]
            for p in m.platforms:
                r = rec_index.get((p, c.key))
                if r is None:
                    cells.append("not measured")
                elif not r.get("supported"):
                    cells.append("cannot run: " + str(r.get("ours", {}).get("status")))
                else:
                    e = r.get("efficiency")
                    pct = (r.get("achieved") or {}).get("ours", {}).get("pct_roofline")
                    best = r.get("best_peer")
                    peer = r["peers"][best]["name"] if best else "no peer"
                    cells.append(f"{fmt_num(e, 2)} vs {peer}; {fmt_pct(pct)}% roof")
            cells += [pp_cell(c.pp_app, c.no_peer, m.short, c.not_measured),
                      pp_cell(c.pp_roof, c.no_roof, m.short, c.not_measured)]
            rows.append(cells)
        lines.append(md_table(header, rows))
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

"""PNG plots (matplotlib's Agg canvas, no display and no pyplot global state).

Per op and dtype, ``<op>_<dtype>.png``: one panel per device, grouped bars per case, in the
op's throughput unit (GFLOP/s; GB/s for memory-bound ops such as softmax and rmsnorm, whose
cost model gives under 2 FLOP per byte). In each group: portakern's best target on that
device first (the target is written under the bar), then the unfused chain (attention), then
each peer, at most ``MAX_SERIES`` bars (the slowest peers are dropped and named in the
panel's title when there are more). Every bar carries its % of the roof; ours also its
efficiency as the tables give it ("1.3×": the median of the per-round ratios to its best
peer, measured side by side; the bars are medians, so the two can differ). The roof of
the case on that device is a black mark across its group. Other portakern targets on the
same device are compared in the tables (REPORT.md), not here: one bar per implementation
keeps a panel readable.

``fleet_<dtype>.png``: efficiency per device (rows) per case (columns) as a heatmap, colour on
a log scale centred on parity (green: faster than the best peer, red: slower), each cell
annotated with the efficiency, the best target and its % of roof.

``implementations_<dtype>.png``: the implementations on the same silicon (implementations.py),
one panel per device with two or more: per case a group of bars, one per implementation of H
(opencl:pocl, opencl:intel, jax, numpy), its efficiency against the fastest implementation
or peer on the device (1 = the fastest), its % of roof written on it, a red cross where it
cannot run; PP over H is a black bar across the group with its value above.

``ratio_stability.png`` (a ``--hog`` run): each ratio (peer / ours, the median of the
per-round ratios with its IQR as a whisker) measured quiet and with a busy loop pinned to one
core, side by side per case and peer, the band of ±10% around the quiet ratio shaded; below,
the difference in percent with the ±10% goal marked.

``bench`` writes all of them for its run; ``report`` all but the last for the merged fleet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

UNIT = {"softmax": "GB/s", "matmul": "GFLOP/s", "attention": "GFLOP/s",
        "attention_backward": "GFLOP/s"}
MEMORY_BOUND_INTENSITY = 2.0  # FLOP/byte: below this an op is plotted in GB/s
MAX_SERIES = 6  # bars per case group
COLOURS = {"ours": "#1f77b4", "unfused": "#aec7e8", "numpy": "#ff7f0e", "torch": "#d62728",
           "xla": "#2ca02c", "clblast": "#9467bd", "cublas": "#8c564b", "cupy": "#e377c2",
           "cudnn": "#7f7f7f"}


def _figure(nrows: int, width: float = 12.0, height: float = 4.2) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * nrows + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, 1, i + 1) for i in range(nrows)]
    return fig, axes


def unit_for(op: str, recs: Sequence[Mapping[str, Any]] = ()) -> str:
    """GB/s for memory-bound ops (bytes are their natural unit), else GFLOP/s. Ops the table
    does not name (user ops) are judged by their cost model's intensity."""
    if op in UNIT:
        return UNIT[op]
    ints = [float(r["cost"]["flops"]) / float(r["cost"]["bytes"]) for r in recs
            if (r.get("cost") or {}).get("flops") is not None and r["cost"].get("bytes")]
    return "GB/s" if ints and max(ints) < MEMORY_BOUND_INTENSITY else "GFLOP/s"


def _rate(unit: str, rec: Mapping[str, Any], seconds: float | None) -> float | None:
    c = rec.get("cost") or {}
    if not seconds or seconds <= 0 or c.get("flops") is None:
        return None
    return (c["bytes"] if unit == "GB/s" else c["flops"]) / seconds / 1e9


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _ok_time(m: Mapping[str, Any] | None) -> float | None:
    if not m or m.get("status") != "ok":
        return None
    t = m.get("median_s")
    return float(t) if t and t > 0 else None


def _labels(recs: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, float] = {}
    for r in recs:
        seen[r["label"]] = max(seen.get(r["label"], 0.0),
                               float((r.get("cost") or {}).get("flops") or 0.0))
    return sorted(seen, key=lambda k: (seen[k], k))


def _best_record(recs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The record of the best portakern target among one case's records on one device:
    highest efficiency, else fastest."""
    ran = [r for r in recs if _ok_time(r.get("ours"))]
    if not ran:
        return None
    with_eff = [r for r in ran if r.get("efficiency") is not None]
    if with_eff:
        return max(with_eff, key=lambda r: float(r["efficiency"]))
    return min(ran, key=lambda r: _ok_time(r.get("ours")) or math.inf)


def _panel_data(recs: Sequence[Mapping[str, Any]], unit: str
                ) -> tuple[list[str], dict[str, dict[str, Any]], dict[str, str], list[str]]:
    """Per case label: {series key: {"rate", "pct", "eff", "target"}}, series names, dropped."""
    labels = _labels(recs)
    by_label: dict[str, list[Mapping[str, Any]]] = {}
    for r in recs:
        by_label.setdefault(r["label"], []).append(r)
    data: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {"ours": "portakern (best target)", "unfused": "portakern unfused"}
    peer_total: dict[str, float] = {}
    for lab in labels:
        group = by_label[lab]
        best = _best_record(group)
        cell: dict[str, Any] = {"roof": None}
        ref = best or group[0]
        bound = (ref.get("roofline") or {}).get("bound_s")
        cell["roof"] = _rate(unit, ref, bound)
        if best is not None:
            t = _ok_time(best.get("ours"))
            cell["ours"] = {"rate": _rate(unit, best, t), "eff": best.get("efficiency"),
                            "pct": (best.get("achieved") or {}).get("ours", {}).get(
                                "pct_roofline"), "target": best.get("target")}
            tu = _ok_time(best.get("unfused"))
            if tu:
                cell["unfused"] = {"rate": _rate(unit, best, tu),
                                   "pct": (best.get("achieved") or {}).get("unfused", {}).get(
                                       "pct_roofline")}
        # each peer: its fastest measurement on this device (it ran beside every target)
        for r in group:
            for k, m in (r.get("peers") or {}).items():
                t = _ok_time(m)
                if t is None:
                    continue
                names[k] = m.get("name", k)
                prev = cell.get(k)
                rate = _rate(unit, r, t)
                if rate and (prev is None or rate > prev["rate"]):
                    pct = 100.0 * bound / t if bound else None
                    cell[k] = {"rate": rate, "pct": pct}
                    peer_total[k] = peer_total.get(k, 0.0)
        for k in list(peer_total):
            if k in cell:
                peer_total[k] += math.log(cell[k]["rate"])
        # ours' label is its efficiency as the tables give it: the median of the per-round
        # ratios to its best peer, measured side by side. (It was our rate over the fastest
        # peer bar, a ratio of medians from different targets' rounds: 1.20x on the plot
        # where the table, from paired rounds, read 1.46x.) The bars are medians.
        data[lab] = cell
    order = ["ours", "unfused"] + sorted(peer_total, key=lambda k: -peer_total[k])
    present = [k for k in order if any(k in data[lab] for lab in labels)]
    dropped = present[MAX_SERIES:]
    return labels, data, {k: names.get(k, k) for k in present[:MAX_SERIES]}, \
        [names.get(k, k) for k in dropped]


def _draw_panel(ax: Any, recs: Sequence[Mapping[str, Any]], unit: str, title: str) -> bool:
    labels, data, series, dropped = _panel_data(recs, unit)
    if not series:
        ax.set_title(title + " — nothing ran")
        return False
    n = len(series)
    width = 0.8 / n
    top = 0.0
    for si, (key, name) in enumerate(series.items()):
        xs, ys = [], []
        for i, lab in enumerate(labels):
            v = data[lab].get(key)
            if v and v.get("rate"):
                xs.append(i - 0.4 + width * (si + 0.5))
                ys.append(v["rate"])
        if not xs:
            continue
        colour = COLOURS.get(key, f"C{si % 10}")
        ax.bar(xs, ys, width * 0.92, color=colour, label=name,
               edgecolor="black" if key == "ours" else colour, linewidth=0.6)
        top = max(top, *ys)
        for x, y, lab in zip(xs, ys, [lab for lab in labels if (data[lab].get(key) or {})
                                      .get("rate")]):
            v = data[lab][key]
            pct = v.get("pct")
            text = f"{pct:.0f}%" if pct is not None else ""
            if key == "ours" and v.get("eff") is not None:
                text = f"{v['eff']:.2g}×\n" + text
            ax.text(x, y, text, ha="center", va="bottom", fontsize=7,
                    fontweight="bold" if key == "ours" else "normal")
            if key == "ours" and v.get("target"):
                ax.text(x, 0, v["target"], ha="center", va="bottom", rotation=90, fontsize=6,
                        color="white")
    first_roof = True
    for i, lab in enumerate(labels):
        roof = data[lab].get("roof")
        if roof:
            ax.hlines(roof, i - 0.45, i + 0.45, colors="black", linewidth=2,
                      label="roof (probes + best rate measured)" if first_roof else None)
            first_roof = False
            top = max(top, roof)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylim(0, top * 1.22 if top else 1)
    ax.set_ylabel(f"{unit} (cost model / median)")
    ax.set_title(title + (f" (not shown: {', '.join(dropped)})" if dropped else ""),
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=min(4, n + 1))
    return True


def _device_of(rec: Mapping[str, Any]) -> str:
    return str(rec.get("device_key") or rec.get("platform") or rec.get("device") or "?")


def plot_records(records: Sequence[Mapping[str, Any]], devices: Sequence[str],
                 device_names: Mapping[str, str], out_dir: str | Path, title: str = "",
                 prefix: str = "") -> list[Path]:
    """The per-op panels and the fleet chart of some records; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["op"], r["dtype"]), []).append(r)
    written = []
    for (op, dtype), recs in sorted(groups.items()):
        unit = unit_for(op, recs)
        devs = [d for d in devices if any(_device_of(r) == d for r in recs)]
        if not devs:
            continue
        fig, axes = _figure(len(devs))
        for ax, d in zip(axes, devs):
            _draw_panel(ax, [r for r in recs if _device_of(r) == d], unit,
                        f"{op} {dtype} on {device_names.get(d, d)}")
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out / f"{prefix}{_safe(op)}_{_safe(dtype)}.png"
        fig.savefig(path)
        written.append(path)
    written += plot_fleet(records, devices, device_names, out, title, prefix)
    written += plot_implementations(records, devices, device_names, out, title, prefix)
    return written


IMPL_COLOURS = ("#1f77b4", "#9467bd", "#2ca02c", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def plot_implementations(records: Sequence[Mapping[str, Any]], devices: Sequence[str],
                         device_names: Mapping[str, str], out_dir: str | Path,
                         title: str = "", prefix: str = "") -> list[Path]:
    """``implementations_<dtype>.png``: per device with two or more implementations, the
    efficiency of each per case (grouped bars) and PP over them (a black bar per group)."""
    from .implementations import members, silicon_cases

    out = Path(out_dir)
    written = []
    for dtype in sorted({r["dtype"] for r in records}):
        recs = [r for r in records if r["dtype"] == dtype]
        cases = silicon_cases(recs, devices)
        devs = [d for d in devices if any(c.device == d for c in cases)]
        if not devs:
            continue
        ncases = max(sum(1 for c in cases if c.device == d) for d in devs)
        fig, axes = _figure(len(devs), width=max(9.0, 1.25 * ncases + 3), height=4.4)
        for ax, d in zip(axes, devs):
            h = members(recs, d)
            cs = [c for c in cases if c.device == d]
            n = len(h)
            width = 0.8 / n
            for si, name in enumerate(h):
                colour = IMPL_COLOURS[si % len(IMPL_COLOURS)]
                xs = [i - 0.4 + width * (si + 0.5) for i in range(len(cs))]
                ys = [float(getattr(c.members.get(name), "efficiency", None) or 0.0)
                      for c in cs]
                ax.bar(xs, ys, width * 0.92, color=colour, label=name)
                for x, y, c in zip(xs, ys, cs):
                    m = c.members.get(name)
                    if m is None or m.status == "not measured":
                        ax.text(x, 0.01, "not\nmeasured", ha="center", va="bottom",
                                fontsize=5.5, rotation=90)
                    elif m.status != "ok":
                        ax.plot([x], [0.02], marker="x", color="#d62728", markersize=8,
                                mew=2)
                        ax.text(x, 0.05, "cannot run", ha="center", va="bottom", fontsize=5.5,
                                rotation=90, color="#d62728")
                    else:
                        pct = "" if m.roof is None else f"\n{100 * m.roof:.0f}%"
                        ax.text(x, y, f"{y:.2g}{pct}", ha="center", va="bottom", fontsize=6,
                                zorder=4, bbox={"facecolor": "white", "alpha": 0.7, "pad": 0.4,
                                                "linewidth": 0})
            for i, c in enumerate(cs):
                pp = c.pp_app.value if c.pp_app is not None else None
                if pp is None:
                    continue
                ax.hlines(pp, i - 0.45, i + 0.45, colors="black", linewidth=2.2,
                          label="PP over H (vs fastest)" if i == 0 else None)
                roof = c.pp_roof.value if c.pp_roof is not None else None
                ax.text(i, 1.12, f"PP {pp:.2g}" + ("" if roof is None
                                                   else f"\n(roofline {roof:.2g})"),
                        ha="center", va="bottom", fontsize=7.5, fontweight="bold")
            ax.set_xticks(range(len(cs)))
            ax.set_xticklabels([f"{c.key[0]}\n{c.key[2]}\nfastest: {c.fastest or '—'}"
                                for c in cs], fontsize=6.5)
            ax.set_xlim(-0.5, len(cs) - 0.5)
            ax.set_ylim(0, 1.32)
            ax.set_ylabel("efficiency = fastest / its time")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", ncol=min(6, n + 1))
            ax.set_title(f"{dtype} on {device_names.get(d, d)}: implementations on the same "
                         "silicon (bar label: efficiency and % of roof)", fontsize=9)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{prefix}implementations_{_safe(dtype)}.png"
        fig.savefig(path)
        written.append(path)
    return written


def plot_fleet(records: Sequence[Mapping[str, Any]], devices: Sequence[str],
               device_names: Mapping[str, str], out_dir: Path, title: str = "",
               prefix: str = "") -> list[Path]:
    """Efficiency of the best portakern target per device (rows) per case (columns)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    written = []
    for dtype in sorted({r["dtype"] for r in records}):
        recs = [r for r in records if r["dtype"] == dtype]
        cols: list[tuple[str, str]] = []
        for op in sorted({r["op"] for r in recs}):
            cols += [(op, lab) for lab in _labels([r for r in recs if r["op"] == op])]
        devs = [d for d in devices if any(_device_of(r) == d for r in recs)]
        if not cols or not devs:
            continue
        grid = np.full((len(devs), len(cols)), np.nan)
        notes = [["" for _ in cols] for _ in devs]
        for i, d in enumerate(devs):
            for j, (op, lab) in enumerate(cols):
                group = [r for r in recs if _device_of(r) == d and r["op"] == op
                         and r["label"] == lab]
                if not group:
                    notes[i][j] = "not\nmeasured"
                    continue
                best = _best_record(group)
                if best is None:
                    notes[i][j] = "cannot\nrun"
                    continue
                e = best.get("efficiency")
                pct = (best.get("achieved") or {}).get("ours", {}).get("pct_roofline")
                if e is not None:
                    grid[i, j] = float(e)
                notes[i][j] = ((f"{e:.2g}×" if e is not None else "no peer") + "\n"
                               + str(best.get("target")) + "\n"
                               + (f"{pct:.0f}% roof" if pct is not None else ""))
        fig, axes = _figure(1, width=max(8.0, 1.05 * len(cols) + 3),
                            height=max(2.4, 1.1 * len(devs) + 1.2))
        ax = axes[0]
        im = ax.imshow(np.clip(grid, 1 / 8, 8), cmap="RdYlGn", norm=LogNorm(1 / 8, 8),
                       aspect="auto")
        for i in range(len(devs)):
            for j in range(len(cols)):
                ax.text(j, i, notes[i][j], ha="center", va="center", fontsize=6.5)
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels([f"{op}\n{lab}" for op, lab in cols], fontsize=7, rotation=30,
                           ha="right")
        ax.set_yticks(range(len(devs)))
        ax.set_yticklabels([device_names.get(d, d) for d in devs], fontsize=8)
        cb = fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
        ticks = [1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8]
        cb.set_ticks(ticks)
        cb.set_ticklabels(["1/8", "1/4", "1/2", "1", "2", "4", "8"])
        cb.minorticks_off()
        cb.set_label("efficiency = best peer time / ours (log)", fontsize=7)
        ax.set_title(f"fleet {dtype}: portakern's best target per device vs the best peer "
                     "on that device" + (f" — {title}" if title else ""), fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{prefix}fleet_{_safe(dtype)}.png"
        fig.savefig(path)
        written.append(path)
    return written


def plot_run(result: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Per-op panels (one per device) and the fleet chart of one run."""
    from .metrics import attach_devices, cpu_model_of, device_key_of

    attach_devices(result)
    env = result.get("environment") or {}
    host = env.get("hostname", "?")
    model = cpu_model_of(result)
    devices: list[str] = []
    names: dict[str, str] = {}
    for t in (result.get("targets") or {}).values():
        d = device_key_of(t, host, model)
        if d not in devices:
            devices.append(d)
            kind = (t.get("device") or {}).get("kind")
            names[d] = (f"{model or 'CPU'} @ {host}" if kind == "cpu"
                        else f"{t['device'].get('name')} @ {host}")
    for r in result.get("cases", []):
        if r.get("device_key") and r["device_key"] not in devices:
            devices.append(r["device_key"])
    commit = ((env.get("git") or {}).get("commit") or "")[:10]
    title = f"{host}, suite {result.get('config', {}).get('suite')}, commit {commit}"
    written = plot_records(result.get("cases", []), devices, names, out_dir, title=title)
    hog = result.get("hog") or {}
    if hog.get("comparison"):
        written.append(plot_stability(hog["comparison"], Path(out_dir), title=title,
                                      core=hog.get("core")))
    return written


def plot_stability(comparison: Sequence[Mapping[str, Any]], out_dir: Path, title: str = "",
                   core: Any = None) -> Path:
    """``ratio_stability.png``: quiet versus hogged ratios (runner.compare_hogged records)."""
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    comp = list(comparison)
    labels = [f"{c['op']} {c['label']}\n{c['name']}" + (" (best)" if c.get("best_peer") else "")
              for c in comp]
    fig, axes = _figure(2, width=max(9.0, 0.8 * len(comp) + 3), height=4.6)
    ax, bx = axes
    x = np.arange(len(comp))
    w = 0.38
    for off, key, colour, name in ((-w / 2, "quiet", "#1f77b4", "quiet"),
                                   (w / 2, "hogged", "#d62728",
                                    f"busy loop on core {core}" if core is not None
                                    else "hogged")):
        med = np.array([c[key]["median"] for c in comp])
        lo = med - np.array([c[key]["q1"] for c in comp])
        hi = np.array([c[key]["q3"] for c in comp]) - med
        ax.bar(x + off, med, w * 0.95, color=colour, label=name + " (median of per-round "
               "ratios, IQR whiskers)", yerr=np.vstack([np.maximum(lo, 0), np.maximum(hi, 0)]),
               capsize=2, ecolor="black", linewidth=0)
    for i, c in enumerate(comp):
        q = c["quiet"]["median"]
        ax.fill_between([i - w, i + w], q * 0.9, q * 1.1, color="grey", alpha=0.25,
                        label="quiet ±10%" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_ylabel("ratio = peer time / ours (log)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(True, axis="y", alpha=0.3, which="both")
    ax.set_title("ratio stability: quiet vs a CPU hog" + (f" — {title}" if title else ""),
                 fontsize=9)
    diffs = [c.get("diff_pct") if c.get("diff_pct") is not None else 0.0 for c in comp]
    colours = ["#2ca02c" if c.get("within_10pct") else "#d62728" for c in comp]
    bx.bar(x, diffs, 0.6, color=colours)
    for xi, d in zip(x, diffs):
        bx.text(xi, d, f"{d:+.0f}%", ha="center", va="bottom" if d >= 0 else "top",
                fontsize=7)
    bx.axhline(10, color="black", linestyle="--", linewidth=0.8, label="±10% goal")
    bx.axhline(-10, color="black", linestyle="--", linewidth=0.8)
    bx.axhline(0, color="black", linewidth=0.6)
    n_ok = sum(1 for c in comp if c.get("within_10pct"))
    bx.set_ylabel("hogged / quiet − 1 (%)")
    for a in (ax, bx):
        a.set_xticks(x)
        a.set_xticklabels(labels, fontsize=6.5, rotation=35, ha="right")
        a.set_xlim(-0.6, len(comp) - 0.4)
        for i in range(1, len(comp)):  # a line between cases
            if comp[i]["id"] != comp[i - 1]["id"] or comp[i]["target"] != comp[i - 1]["target"]:
                a.axvline(i - 0.5, color="grey", linewidth=0.6, alpha=0.6)
    bx.legend(fontsize=7, loc="best")
    bx.grid(True, axis="y", alpha=0.3)
    bx.set_title(f"difference from the quiet ratio: {n_ok} of {len(comp)} within ±10%",
                 fontsize=9)
    fig.tight_layout()
    path = out_dir / "ratio_stability.png"
    fig.savefig(path)
    return path


def plot_report(merged: Any, out_dir: str | Path) -> list[Path]:
    """Per-op panels (one per device) and the fleet chart of a merged report."""
    names = {d: f"{merged.device_short.get(d, d)}: {merged.device_label.get(d, d)}"
             for d in merged.devices}
    return plot_records(merged.records, merged.devices, names, out_dir, prefix="report_")

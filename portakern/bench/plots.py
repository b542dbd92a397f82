"""PNG plots (matplotlib's Agg canvas, no display and no pyplot global state).

Run plots, one per op and dtype: throughput against problem size for each target — our
kernel (solid), each native peer (dashed), the unfused chain (dotted) and the roofline bound
from our probes (thin grey-ish line in the target's colour). Throughput is GFLOP/s for
matmul/attention and GB/s for softmax (memory-bound: bytes are its natural unit); both come
from the op's cost model, so every line of a plot divides the same work by its own time.

Report plots, one per op and dtype: efficiency (peer time / our time) per platform against
size, with PP across platforms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

UNIT = {"softmax": "GB/s", "matmul": "GFLOP/s", "attention": "GFLOP/s"}
MEMORY_BOUND_INTENSITY = 2.0  # FLOP/byte: below this an op is plotted in GB/s
# (line style, marker) per implementation, so peers of one target (one colour) stay apart
STYLE = {"ours": ("-", "o"), "unfused": (":", "s"), "numpy": ("--", "^"), "xla": ("-.", "v"),
         "clblast": ((0, (3, 1, 1, 1)), "D"), "cublas": ("--", "P"), "cupy": ("-.", "X"),
         "cudnn": ((0, (1, 1)), "*")}


def _figure() -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


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


def _ordered_labels(recs: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, float] = {}
    for r in recs:
        seen[r["label"]] = max(seen.get(r["label"], 0.0),
                               float((r.get("cost") or {}).get("flops") or 0.0))
    return sorted(seen, key=lambda k: (seen[k], k))


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def plot_run(result: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """One PNG per (op, dtype) of a run; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in result.get("cases", []):
        groups.setdefault((r["op"], r["dtype"]), []).append(r)
    written = []
    for (op, dtype), recs in sorted(groups.items()):
        labels = _ordered_labels(recs)
        unit = unit_for(op, recs)
        xs = {lab: i for i, lab in enumerate(labels)}
        fig, ax = _figure()
        colors = ["C0", "C1", "C2", "C3", "C4", "C5"]
        targets = sorted({r["target"] for r in recs})
        anything = False
        for ti, tgt in enumerate(targets):
            col = colors[ti % len(colors)]
            trecs = sorted((r for r in recs if r["target"] == tgt), key=lambda r: xs[r["label"]])
            series: dict[str, list[tuple[int, float]]] = {}
            names: dict[str, str] = {"ours": "portakern", "unfused": "portakern unfused"}
            roof: list[tuple[int, float]] = []
            for r in trecs:
                x = xs[r["label"]]
                impls = {"ours": r.get("ours") or {}, "unfused": r.get("unfused") or {}}
                for k, m in r.get("peers", {}).items():
                    impls[k] = m
                    names[k] = m.get("name", k)
                for k, m in impls.items():
                    y = _rate(unit, r, m.get("median_s")) if m.get("status") == "ok" else None
                    if y:
                        series.setdefault(k, []).append((x, y))
                bs = (r.get("roofline") or {}).get("bound_s")
                y = _rate(unit, r, bs)
                if y:
                    roof.append((x, y))
            for k, pts in series.items():
                ls, mk = STYLE.get(k, ("--", "^"))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=ls, color=col,
                        marker=mk, lw=2.2 if k == "ours" else 1.2,
                        label=f"{tgt}: {names.get(k, k)}")
                anything = True
            if roof:
                ax.plot([p[0] for p in roof], [p[1] for p in roof], "-", color=col, lw=0.8,
                        alpha=0.5, label=f"{tgt}: roofline (our probes)")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        if anything:
            ax.set_yscale("log")
        ax.set_ylabel(f"{unit} (cost model / median time)")
        ax.set_title(f"{op} {dtype} — {result.get('environment', {}).get('hostname', '')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = out / f"{_safe(op)}_{_safe(dtype)}.png"
        fig.savefig(path)
        written.append(path)
    return written


def plot_report(merged: Any, out_dir: str | Path) -> list[Path]:
    """Efficiency per platform vs size, one PNG per (op, dtype) of a merged report."""
    from .report import portability

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = portability(merged.records, merged.platforms)
    groups: dict[tuple[str, str], list[Any]] = {}
    for c in cases:
        groups.setdefault((c.key[0], c.key[1]), []).append(c)
    written = []
    for (op, dtype), cs in sorted(groups.items()):
        fig, ax = _figure()
        labels = [c.key[2] for c in cs]
        for i, p in enumerate(merged.platforms):
            pts = [(j, c.efficiency[p]) for j, c in enumerate(cs)
                   if c.efficiency.get(p) is not None and c.efficiency[p] > 0]
            if pts:
                ax.plot([q[0] for q in pts], [q[1] for q in pts], "-o", color=f"C{i % 10}",
                        label=f"{merged.short[p]}: {p}")
        pps = [(j, c.pp_app.value) for j, c in enumerate(cs)
               if c.pp_app is not None and c.pp_app.value]
        if pps:
            ax.plot([q[0] for q in pps], [q[1] for q in pps], "k--", lw=2, label="PP (vs peers)")
        zero = [j for j, c in enumerate(cs) if c.pp_app is not None and c.pp_app.value == 0]
        for j in zero:
            ax.axvline(j, color="red", alpha=0.3, lw=6)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ys = [v for c in cs for v in c.efficiency.values() if v] + [1.0]
        if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
        ax.set_ylabel("efficiency = peer time / portakern time")
        ax.set_title(f"{op} {dtype}: efficiency per platform"
                     + (" (red: PP = 0, a platform cannot run it)" if zero else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / f"report_{_safe(op)}_{_safe(dtype)}.png"
        fig.savefig(path)
        written.append(path)
    return written

"""`portakern bench` and `portakern report`: argument parsing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from .suites import SIZES


def _csv(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    return items or None


# where a user's run writes: never a tracked file (issue 26, item 5). The committed
# results (benchmarks/results/<host>.*) are written only with an explicit --out.
RUNS_DIR = Path("benchmarks") / "runs"  # git-ignored (.gitignore) in the checkout


@dataclass(frozen=True)
class Outputs:
    """The files a `portakern bench` run writes: the JSON, the markdown beside it, the plots."""

    json: Path
    markdown: Path
    plots: Path | None
    default: bool  # True: chosen by the bench (no --out), an untracked place


def checkout_root() -> Path | None:
    """The portakern source checkout this module runs from (an editable install), else None."""
    root = Path(__file__).resolve().parents[3]
    if (root / ".git").exists() and (root / "pyproject.toml").is_file() \
            and (root / "benchmarks").is_dir():
        return root
    return None


def default_run_dir(hostname: str | None = None, now: datetime.datetime | None = None
                    ) -> Path:
    """``benchmarks/runs/<host>-<UTC time>/`` of the checkout (git-ignored), or the same under
    the user's cache (``<cache root>/bench/runs``) when portakern is not run from a checkout."""
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_"
                   for ch in (hostname or socket.gethostname()))
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    root = checkout_root()
    if root is not None:
        base = root / RUNS_DIR
    else:
        from ...core.cache import cache_root

        base = cache_root() / "bench" / "runs"
    return base / f"{host}-{stamp}"


def resolve_outputs(out: str | None, plots: str | None, no_plots: bool, *,
                    hostname: str | None = None, now: datetime.datetime | None = None
                    ) -> Outputs:
    """Where a run writes. Without ``--out``: ``results.json``, ``results.md`` and ``plots/``
    in a new ``default_run_dir``. With it: that file, its ``.md`` and ``<out>-plots/``."""
    if out is None:
        run = _near(default_run_dir(hostname, now))
        j = run / "results.json"
        pl = None if no_plots else Path(plots) if plots else run / "plots"
        return Outputs(j, j.with_suffix(".md"), pl, True)
    j = Path(out)
    pl = None if no_plots else Path(plots) if plots else Path(str(j.with_suffix("")) + "-plots")
    return Outputs(j, j.with_suffix(".md"), pl, False)


def _near(path: Path) -> Path:
    """``path`` relative to the working directory when it lies under it (a result file then
    records ``benchmarks/runs/...``, not a path naming the user's home), else as it is."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _hog_core(text: str | None) -> int | None:
    """--hog's core: None without --hog, -1 for the last usable core."""
    if text is None:
        return None
    if text == "auto":
        return -1
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--hog {text!r}: expected a core number (or --hog alone for the "
                         "last usable core)") from None


def _bench(args: argparse.Namespace) -> int:
    from .peers import PEER_KEYS
    from .plots import plot_run
    from .report import run_markdown
    from .runner import BenchConfig, run_bench, with_timing_overrides
    from .suites import TIMING

    backends: list[str] = []
    for b in args.backends or []:
        backends.extend(_csv(b) or ())
    peers = _csv(args.peers)
    if peers and peers != ("all",):
        bad = [p for p in peers if p not in PEER_KEYS]
        if bad:
            print(f"portakern bench: unknown peer(s) {bad}; expected some of "
                  f"{', '.join(PEER_KEYS)} (or 'all').", file=sys.stderr)
            return 2
    else:
        peers = None
    if peers == ():
        peers = None
    where = resolve_outputs(args.out, args.plots, args.no_plots)
    out = str(where.json)
    plots_dir = None if where.plots is None else str(where.plots)
    try:
        timing = with_timing_overrides(TIMING[args.suite], min_time=args.min_time,
                                       min_reps=args.min_reps, max_reps=args.max_reps,
                                       budget_s=args.budget)
        if args.remeasure < 0:
            raise ValueError(f"--remeasure {args.remeasure}: expected 0 or more")
        hog = _hog_core(args.hog)
    except ValueError as exc:
        print(f"portakern bench: {exc}", file=sys.stderr)
        return 2
    cfg = BenchConfig(suite=args.suite, ops=_csv(args.ops), targets=tuple(backends) or None,
                      dtypes=_csv(args.dtypes), peers=peers, limit=args.limit, out=out,
                      plots=plots_dir, probes=not args.no_probes, unfused=not args.no_unfused,
                      timing=timing, dispatch=args.dispatch,
                      cases=tuple(args.case) if args.case else None,
                      remeasure=args.remeasure, hog=hog)
    from ...core.errors import PortakernError

    if where.default:
        print(f"portakern bench: writing to {where.json.parent}{os.sep} (untracked; to "
              "replace the committed results, a maintainer passes --out "
              f"benchmarks/results/{socket.gethostname()}.json)", file=sys.stderr)
    try:
        result = run_bench(cfg)
    except (ValueError, LookupError, PortakernError) as exc:
        print(f"portakern bench: {exc}", file=sys.stderr)
        return 2
    md = run_markdown(result)
    where.markdown.write_text(md)
    if plots_dir and result.get("cases"):
        files = plot_run(result, plots_dir)
        print(f"plots: {', '.join(str(f) for f in files)}", file=sys.stderr)
    print(md)
    print(f"results: {where.json} (+ {where.markdown})", file=sys.stderr)
    if result.get("interrupted"):
        return 130
    return 0 if result.get("targets") else 1


def _report(args: argparse.Namespace) -> int:
    from .report import write_report

    try:
        path = write_report(args.files, args.out, plots=not args.no_plots)
    except (ValueError, FileNotFoundError) as exc:
        print(f"portakern report: {exc}", file=sys.stderr)
        return 2
    print(path.read_text())
    print(f"report: {path}", file=sys.stderr)
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `portakern bench` on the CLI's subparsers."""
    p = sub.add_parser(
        "bench", help="our kernels vs each device's native library, with the roofline",
        description="Time each op x size x dtype on every target beside the best native peer "
                    "on the same device (numpy/BLAS, XLA, CLBlast, cuBLAS, cuDNN), the unfused "
                    "chains (attention, attention_backward) and the roofline from portakern's "
                    "own probes. "
                    "Ctrl-C stops and writes what was measured. See docs/bench.md.")
    p.add_argument("--ops", default=None,
                   help="comma-separated ops (default: every registered op, plugins and ops "
                        "registered by user code included)")
    p.add_argument("--suite", choices=sorted(SIZES), default="quick",
                   help="quick: a few sizes, fp32, < 5 min on a 2-core CPU; full: size and "
                        "dtype sweeps for GPUs")
    p.add_argument("--backends", action="append", default=None,
                   help="targets, comma-separated or repeated (e.g. opencl:0,jax); default: "
                        "every available target except numpy")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated dtypes (default: quick float32; full float32,"
                        "float16,bfloat16)")
    p.add_argument("--peers", default=None,
                   help="comma-separated peers to run (numpy, xla, clblast, cublas, cupy, "
                        "cudnn; default all that apply)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N (smallest) sizes of each op")
    p.add_argument("--out", default=None,
                   help="result JSON, a .md table written beside it (default: a new "
                        "benchmarks/runs/<hostname>-<UTC time>/results.json, git-ignored; "
                        "the committed results are written only with an explicit --out "
                        "benchmarks/results/<hostname>.json)")
    p.add_argument("--plots", default=None,
                   help="directory for PNG plots (default: beside --out, or plots/ in the run "
                        "directory)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds of samples per measurement (suite default 0.2 / 0.5)")
    p.add_argument("--min-reps", type=int, default=None, help="samples per measurement at least")
    p.add_argument("--max-reps", type=int, default=None, help="samples per measurement at most")
    p.add_argument("--budget", type=float, default=None,
                   help="time box in seconds for one measurement, first call included "
                        "(suite default 25 / 60)")
    p.add_argument("--case", action="append", default=None, metavar="TEXT",
                   help="keep only the cases whose id (op/dtype/size, e.g. "
                        "'attention/float32/B1 H8 S4096 D64 causal') contains TEXT; repeatable")
    p.add_argument("--remeasure", type=int, default=1, metavar="N",
                   help="measure a case again, at most N times, while other processes use "
                        "more than 10%% of the CPUs; the least contended attempt is kept "
                        "(default 1; 0: never)")
    p.add_argument("--hog", nargs="?", const="auto", default=None, metavar="CORE",
                   help="measure every case twice: quiet, then with a busy loop (python -c "
                        "'while True: pass') pinned to CORE (default: the last usable core); "
                        "the table and ratio_stability.png compare the ratios")
    p.add_argument("--no-probes", action="store_true", help="skip the roofline probes")
    p.add_argument("--no-unfused", action="store_true", help="skip the unfused chains (attention, "
                   "attention_backward)")
    p.add_argument("--dispatch", dest="dispatch", action="store_true", default=None,
                   help="measure the dispatch overhead (pk.call vs a raw enqueue of the same "
                        "kernel on a tiny softmax; default: in the quick suite)")
    p.add_argument("--no-dispatch", dest="dispatch", action="store_false",
                   help="skip the dispatch-overhead measurement")
    p.set_defaults(fn=_bench)
    return p


def add_report_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `portakern report` on the CLI's subparsers."""
    p = sub.add_parser(
        "report", help="merge bench result files from several machines into REPORT.md",
        description="Merge `portakern bench` result files (one per machine) into one report: "
                    "per op and size, each platform's efficiency and the performance "
                    "portability across devices; per device, its implementations (e.g. PoCL "
                    "and Intel's OpenCL on one CPU, jax, numpy) side by side with PP over "
                    "them; plus plots.")
    p.add_argument("files", nargs="+", help="result JSON files (e.g. benchmarks/results/*.json)")
    p.add_argument("--out", default="benchmarks", help="directory for REPORT.md and plots/")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    p.set_defaults(fn=_report)
    return p

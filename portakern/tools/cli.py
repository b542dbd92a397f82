"""The ``portakern`` command: info | show | check | resources | bench | report | tune.

Each subcommand lives in the module that owns its job; this file only wires arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def _info(args: argparse.Namespace) -> int:
    from ..backend import registry
    from ..core import settings
    from ..runtime import selection

    report = {}
    for name in registry.names():
        av = registry.availability(name)
        report[name] = av.as_dict()
        tuned = [_tuned(name, d, av.versions) for d in av.devices]
        for row, t in zip(report[name]["devices"], tuned, strict=True):
            row["tuned"] = t
        if args.json:
            continue
        state = "available" if av.available else "unavailable"
        vers = ", ".join(f"{k} {v}" for k, v in av.versions.items())
        print(f"{name:8s} {state}{'  (' + vers + ')' if vers else ''}")
        if not av.available:
            print(f"         why: {av.reason}")
            print(f"         fix: {av.fix}")
        for d, t in zip(av.devices, tuned, strict=True):
            print(f"         {name}:{d.index}  {d.kind:5s} {d.name}  [{d.vendor} {d.driver}]"
                  f"{'' if d.fp64 else '  (no fp64)'}")
            if d.extra.get("alias"):  # opencl:pocl, opencl:oclgrind (and what it is for)
                purpose = d.extra.get("purpose") or d.platform
                print(f"           = {name}:{d.extra['alias']}: {purpose}")
            for line in t:
                print(f"           tuned: {_format_tuned(line)}")
    try:
        choice = selection.explain()
    except Exception as exc:  # report, don't crash: info is what users run when things break
        choice = f"no usable backend ({exc})"
    env = settings.describe()
    torch_row = _torch_info()
    if args.json:
        print(json.dumps({"backends": report, "automatic": choice, "torch": torch_row,
                          "settings": {row.name: {"attribute": f"settings.{row.path}",
                                                   "value": row.shown, "doc": row.doc}
                                       for row in env}},
                         indent=2, default=str))
    else:
        print(f"\nautomatic selection: {choice}")
        if torch_row is not None:
            print(f"torch: {torch_row['version']}, CUDA available: {torch_row['cuda']}"
                  f"{' (' + torch_row['error'] + ')' if torch_row.get('error') else ''}; "
                  "portakern.torch: torch.ops.portakern.* (docs/torch.md)")
        print("\nsettings (environment variables, portakern/core/settings.py):")
        for row in env:
            print(f"  {row.name} = {row.shown}   (settings.{row.path})\n      {row.doc}")
    return 0


def _torch_info() -> dict | None:
    """torch's version and whether it sees CUDA, when it is installed (None when not)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        return {"version": torch.__version__, "cuda": bool(torch.cuda.is_available())}
    except Exception as exc:  # info must report, never crash
        return {"version": "unimportable", "cuda": False, "error": f"{type(exc).__name__}: {exc}"}


def _tuned(name: str, device: object, versions: dict) -> list[dict]:
    """Tuned entries of one device (runtime.configs); [] when the tuner or its DB is absent."""
    try:
        from ..runtime.configs import tuned_summary

        return tuned_summary(name, device, versions)  # type: ignore[arg-type]  # a DeviceInfo
    except Exception:  # info must report, never crash
        return []


def _format_tuned(row: dict) -> str:
    from ..runtime.configs import format_entry

    return format_entry(row)


def _sizes(text: str | None) -> None:
    """Refuse a --shape with a negative size before anything is rendered or run."""
    from ..core.errors import InvalidArgumentError
    from .show import parse_sizes

    for k, v in parse_sizes(text).items():
        if v < 0:
            raise InvalidArgumentError(f"--shape {k}={v}: sizes must be >= 0; e.g. {k}=64.")


def _show(args: argparse.Namespace) -> int:
    from .show import show

    _sizes(args.shape)
    print(show(args.op, args.backend, dtype=args.dtype, shape=args.shape))
    return 0


def _check(args: argparse.Namespace) -> int:
    from ..core import dtypes
    from ..core.errors import InvalidArgumentError
    from ..ops import get_op

    # a run that would check nothing is an error, not a pass
    if args.examples is not None and args.examples < 1:
        raise InvalidArgumentError(f"--examples {args.examples}: expected at least 1 case per "
                                   "op x dtype, e.g. --examples 25.")
    for op in (args.ops.split(",") if args.ops else []):
        get_op(op.strip())  # InvalidArgumentError naming the registered ops
    for dt in (args.dtypes.split(",") if args.dtypes else []):
        if dt.strip() not in dtypes.FLOAT_DTYPES:
            raise InvalidArgumentError(f"--dtypes {dt!r} is not a dtype portakern computes in; "
                                       f"expected some of {', '.join(dtypes.FLOAT_DTYPES)}.")
    if args.compile_only:
        from .compile_check import main as compile_main

        return compile_main(args)
    from .conformance import main as conformance_main

    return conformance_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="portakern", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="backends, devices, versions; why a backend is unavailable")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=_info)

    s = sub.add_parser("show", help="print an op's kernel rendered for a backend's dialect")
    s.add_argument("op")
    s.add_argument("--backend", default="opencl", help="opencl, cuda or hip (dialect or backend)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--shape", default=None,
                   help="representative problem, e.g. 'B=1,H=8,S=128,D=64' (op-specific)")
    s.set_defaults(fn=_show)

    s = sub.add_parser("check", help="conformance run: the shared properties on each backend")
    s.add_argument("--backend", action="append", default=None,
                   help="backend selector (repeatable); default: every available target")
    s.add_argument("--ops", default=None, help="comma-separated ops (default: all registered)")
    s.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: all)")
    s.add_argument("--examples", type=int, default=None,
                   help="random cases per op x dtype (default 25; 4 on opencl:oclgrind)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=None, help="write the result file (JSON) here")
    s.add_argument("--compile-only", action="store_true",
                   help="compile every op x dtype x schedule for the backend's dialect without "
                        "running (CUDA via NVRTC for several architectures; no GPU needed)")
    s.add_argument("--arch", action="append", default=None,
                   help="with --compile-only: CUDA compute capabilities (default 70, 80, 90) "
                        "or AMD gfx targets (default gfx906, gfx90a, gfx1030 and any further "
                        "one hipcc accepts)")
    s.set_defaults(fn=_check)

    try:
        from .bench.cli import add_bench_parser, add_report_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
        add_report_parser(sub)
    from .resources import add_resources_parser

    add_resources_parser(sub)
    try:
        from .autotune import add_tune_parser
    except ImportError:
        pass
    else:
        add_tune_parser(sub)
    from .trace import add_trace_parser

    add_trace_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 success, 1 a check or run failed, 2 a usage error (argparse's too),
    130 interrupted. A user's mistake is one line on stderr, never a traceback."""
    from ..core.errors import PortakernError

    args = build_parser().parse_args(argv)
    if isinstance(getattr(args, "shape", None), str) and args.fn is not _show:
        try:
            _sizes(args.shape)
        except PortakernError as exc:
            print(f"portakern {args.command}: {exc}", file=sys.stderr)
            return 2
    try:
        code = int(args.fn(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:  # `portakern show ... | head -1`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush cannot complain
        return 141  # 128 + SIGPIPE, what a shell reports for a writer the pipe stopped
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except PortakernError as exc:
        print(f"portakern {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave (--out, --plots) that cannot be used
        print(f"portakern {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

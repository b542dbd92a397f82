"""Running a compile-only tool (ptxas, cuobjdump, hipcc) as a child process.

One rule for all of them: a tool that will not start (missing, not executable, not a
program), times out or, where the caller says so, exits non-zero becomes a ToolchainError
naming the command, its stderr and the fix; never an OSError, a TimeoutExpired or a bare
RuntimeError with a traceback. A compile error in the kernel's source is not decided here:
hipcc's callers tell the two apart (hipcc.toolchain_failure).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from ..core.errors import ToolchainError


def run(tool: str, cmd: Sequence[str], *, what: str, fix: str, timeout: float,
        check: bool = True, cwd: str | None = None, env: Mapping[str, str] | None = None,
        shown: Sequence[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd)`` with text output captured; ToolchainError (``what`` failed,
    the command as ``shown`` or as run, stderr, ``fix``) when it cannot start, times out, or
    (``check``) exits non-zero."""
    shown_cmd = tuple(shown if shown is not None else cmd)
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, errors="replace",
                              timeout=timeout, cwd=cwd,
                              env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else (exc.stderr or "")
        raise ToolchainError(f"{what}: {tool} did not finish within {timeout:g} s",
                             tool=tool, command=shown_cmd, stderr=err, fix=fix) from None
    except OSError as exc:  # missing, not executable, not a program (exec format error)
        why = exc.strerror or type(exc).__name__
        raise ToolchainError(f"{what}: {tool} could not be started ({why}: {cmd[0]})",
                             tool=tool, command=shown_cmd, stderr=str(exc), fix=fix) from None
    if check and done.returncode != 0:
        raise ToolchainError(f"{what}: {tool} failed", tool=tool, command=shown_cmd,
                             returncode=done.returncode, stderr=done.stderr or "",
                             stdout=done.stdout or "", fix=fix)
    return done


def executable(path: str) -> bool:
    """A regular file this process may execute."""
    return os.path.isfile(path) and os.access(path, os.X_OK)

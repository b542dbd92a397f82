"""Every error portakern raises, in one place.

Each class also derives from the builtin a caller would catch without knowing portakern
(ValueError for bad values and shapes, TypeError for dtypes and non-arrays, RuntimeError
for backend failures, MemoryError for allocation failures), so existing code keeps working.
Messages follow one rule: say what was wrong, what was expected, and how to fix it.
"""

from __future__ import annotations

import shlex


class PortakernError(Exception):
    """Base of every portakern error."""


class ShapeError(PortakernError, ValueError):
    """An operand's rank or dimensions do not fit the op's signature."""


class DTypeError(PortakernError, TypeError):
    """Operand dtypes are mixed, unsupported, or not what the op accepts."""


class UnsupportedDTypeError(DTypeError):
    """The dtype is valid for the op but the selected device cannot compute it (e.g. fp64)."""


class NotAnArrayError(PortakernError, TypeError):
    """An operand is not an array (numpy, a backend's device array, or array-like)."""


class InvalidArgumentError(PortakernError, ValueError):
    """A non-array argument (axis, scale, mask, tunable, option) is out of its domain."""


class BackendUnavailable(PortakernError, RuntimeError):
    """The requested backend or device cannot run here; the message names the reason and fix."""


class UnknownBackendError(BackendUnavailable, ValueError):
    """The backend string names no registered backend or is malformed."""


class CompileError(PortakernError, RuntimeError):
    """A rendered kernel failed to compile. Carries the device, options, numbered source, log."""

    def __init__(self, message: str, *, source: str = "", log: str = "", options: tuple = (),
                 device: str = "") -> None:
        self.source = source
        self.log = log
        self.options = tuple(options)
        self.device = device
        numbered = number_lines(source) if source else ""
        full = (f"{message}\n  device: {device}\n  options: {' '.join(self.options) or '(none)'}\n"
                f"--- compiler log ---\n{log.strip()}\n--- rendered source ---\n{numbered}")
        super().__init__(full)


class ToolchainError(BackendUnavailable):
    """A compile-only tool (ptxas, cuobjdump, hipcc) is there but could not do its job: it
    would not start, timed out, or failed for a reason that is not the kernel's source.

    ``tool``, ``command`` (as run), ``returncode`` (None when it never ran to an exit),
    ``stderr`` and ``stdout`` (whole) describe the run; the message names the command, the
    trimmed stderr (stdout's last lines when stderr is empty) and ``fix``. A
    BackendUnavailable: that target cannot be used here until the tool is fixed, so callers
    that report an unavailable target report this one too."""

    STDERR_LINES = 20  # the message keeps the last lines (and at most 2000 characters)

    def __init__(self, message: str, *, tool: str = "", command: tuple = (),
                 returncode: int | None = None, stderr: str = "", stdout: str = "",
                 fix: str = "") -> None:
        self.tool = tool
        self.command = tuple(str(c) for c in command)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        self.fix = fix
        status = ("" if returncode is None else f" (exit status {returncode})")
        full = (f"{message}{status}\n  command: {shlex.join(self.command) or '(none)'}\n"
                f"  stderr: {_trim(stderr, self.STDERR_LINES) or '(empty)'}")
        if not stderr.strip() and stdout.strip():
            full += f"\n  stdout: {_trim(stdout, 5)}"
        if fix:
            full += f"\n  Fix: {fix}"
        super().__init__(full)


class KernelFaultError(PortakernError, RuntimeError):
    """A checking device (the Oclgrind simulator, ``opencl:oclgrind``) saw a kernel misbehave:
    a data race, an out-of-bounds access, a use of an uninitialised value or invalid API use.

    ``kernel``, ``kind`` and ``line`` describe the first report; ``reports`` holds every
    distinct one (kind, line, source line, work-items, headline) and ``log`` the simulator's
    own text."""

    def __init__(self, message: str, *, kernel: str = "", kind: str = "", line: int | None = None,
                 source_line: str = "", work_items: tuple[str, ...] = (),
                 reports: tuple = (), log: str = "") -> None:
        self.kernel = kernel
        self.kind = kind
        self.line = line
        self.source_line = source_line
        self.work_items = tuple(work_items)
        self.reports = tuple(reports)
        self.log = log
        super().__init__(message)


class DeviceMemoryError(PortakernError, MemoryError):
    """A device allocation failed; the message names the requested and available sizes."""


class ForkedProcessError(BackendUnavailable):
    """This process was forked after a device runtime that cannot survive fork was initialised
    (OpenCL drivers, CUDA); the message names fork and the fix (spawn or forkserver)."""


class ContextMismatchError(BackendUnavailable, ValueError):
    """A device array belongs to another context (device, process) than the selected backend;
    the message names both and the fix."""


class HostMemoryError(PortakernError, MemoryError):
    """A host copy a call would make exceeds portakern's host memory budget (named sizes)."""


class AliasingError(InvalidArgumentError):
    """``out=`` overlaps an input: the kernel would read what it has already overwritten."""


class SpecError(PortakernError, ValueError):
    """A KernelSpec is malformed: the message names the spec, the field and the fix."""


def _trim(text: str, most: int) -> str:
    """The last ``most`` lines of a tool's output (2000 characters at most), indented."""
    lines = text.strip().splitlines()
    shown = "\n    ".join(lines[-most:])[-2000:]
    if len(lines) > most:
        shown = f"(last {most} of {len(lines)} lines)\n    " + shown
    return shown


def number_lines(source: str) -> str:
    """Return source with 1-based line numbers, as compiler logs refer to them."""
    lines = source.splitlines()
    width = len(str(len(lines)))
    return "\n".join(f"{i + 1:>{width}} | {line}" for i, line in enumerate(lines))

"""A compile-only tool that fails is a ToolchainError naming the command, its stderr and the
fix, never a raw traceback: ptxas and hipcc through ``portakern resources`` / ``portakern
check --compile-only`` (tools.cli.main) and their toolchain hooks, cuobjdump through
``ptxas.cubin_resources``. The tools are stand-ins: scripts that print to stderr and exit 1,
and /bin/false; none needs a GPU or the real tool, except that the cuda path compiles the
kernel with NVRTC (a pip wheel) before ptxas runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from portakern import toolchains
from portakern.core.errors import CompileError, ToolchainError
from portakern.tools import cli

from conftest import require_tool

ptxas = importlib.import_module("portakern.toolchains.ptxas")
hip = importlib.import_module("portakern.toolchains.hipcc")
STDERR = "fatal   : simulated failure of the stand-in tool"


def _failing(tmp_path: Path, name: str, body: str | None = None) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + (body or f'echo "{STDERR}" >&2\nexit 1') + "\n")
    path.chmod(0o755)
    return str(path)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    got = capsys.readouterr()
    return rc, got.out + got.err


def _no_traceback(out: str) -> None:
    assert "Traceback" not in out and "RuntimeError" not in out, out


def _need_nvrtc() -> None:
    try:
        from portakern.toolchains import nvrtc

        nvrtc.version()
    except Exception as exc:
        require_tool(None, f"NVRTC cannot be loaded ({exc}); the cuda resource path compiles "
                     "with it before ptxas runs", "pip install 'portakern[cuda]'")


# --- ptxas ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stand_in", ["script", "/bin/false"])
def test_failing_ptxas_on_the_cli(stand_in: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    _need_nvrtc()
    exe = _failing(tmp_path, "ptxas") if stand_in == "script" else stand_in
    monkeypatch.setenv("PORTAKERN_PTXAS", exe)
    rc, out = _cli(capsys, "resources", "matmul", "--backend", "cuda", "--arch", "sm_80")
    assert rc == 2, out
    _no_traceback(out)
    line = next(ln for ln in out.splitlines() if ln.startswith("error:"))
    assert "ptxas failed" in line and "sm_80" in line, out
    assert f"command: {exe} -v --gpu-name sm_80" in out
    assert "exit status 1" in out and "Fix:" in out and "PORTAKERN_PTXAS" in out
    if stand_in == "script":
        assert STDERR in out


def test_failing_ptxas_hook_raises_toolchain_error(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the target's kernel_resources hook and ptxas_resources itself (the
    stand-in never reads the PTX, so no NVRTC is needed for the second)."""
    exe = _failing(tmp_path, "ptxas")
    monkeypatch.setenv("PORTAKERN_PTXAS", exe)
    with pytest.raises(ToolchainError) as info:
        ptxas.ptxas_resources(".version 8.8\n.target sm_80\n", "90")
    err = info.value
    assert err.tool == "ptxas" and err.command[0] == exe and err.returncode == 1
    assert STDERR in err.stderr and STDERR in str(err) and exe in str(err)
    assert "Fix:" in str(err)
    _need_nvrtc()
    with pytest.raises(ToolchainError, match="simulated failure"):
        toolchains.get("cuda").kernel_resources(
            'extern "C" __global__ void k(float* p) { p[0] = 1.0f; }\n', "80", "k.cu")


def test_old_ptxas_names_the_version_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = _failing(tmp_path, "ptxas", 'echo "ptxas fatal   : Unsupported .version 8.8; current '
                   'version is \'8.5\'" >&2\nexit 255')
    monkeypatch.setenv("PORTAKERN_PTXAS", exe)
    with pytest.raises(ToolchainError) as info:
        ptxas.ptxas_resources(".version 8.8\n.target sm_80\n", "80")
    msg = str(info.value)
    assert "Unsupported .version 8.8" in msg and "exit status 255" in msg
    assert "older than the NVRTC that wrote PTX ISA 8.8" in msg and "nvidia-cuda-nvcc-cu12" in msg


def test_ptxas_that_cannot_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_program = tmp_path / "ptxas"
    not_a_program.write_text("no shebang, no execute bit\n")
    monkeypatch.setenv("PORTAKERN_PTXAS", str(not_a_program))
    with pytest.raises(ToolchainError, match="could not be started") as info:
        ptxas.ptxas_resources(".version 8.8\n", "80")
    assert info.value.returncode is None and str(not_a_program) in str(info.value)


# --- hipcc ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stand_in", ["script", "/bin/false"])
def test_failing_hipcc_on_the_cli(stand_in: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    exe = _failing(tmp_path, "hipcc") if stand_in == "script" else stand_in
    monkeypatch.setenv("PORTAKERN_HIPCC", exe)
    monkeypatch.setattr(hip, "_VERSION", {})
    for argv in (("resources", "matmul", "--backend", "hip", "--arch", "gfx90a"),
                 ("check", "--compile-only", "--backend", "hip", "--ops", "softmax",
                  "--arch", "gfx90a")):
        rc, out = _cli(capsys, *argv)
        assert rc == 2, out
        _no_traceback(out)
        assert any(ln.startswith("error:") and "hipcc failed" in ln
                   for ln in out.splitlines()), out
        assert f"command: {exe} --version" in out and "Fix:" in out and "PORTAKERN_HIPCC" in out
        if stand_in == "script":
            assert STDERR in out


def test_hipcc_that_compiles_nothing_is_the_toolchains_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """hipcc answers --version but fails on every source without pointing into it (missing
    device libraries): a ToolchainError through the compile hook, not a CompileError with the
    numbered source; a message located in the source stays a CompileError."""
    exe = _failing(tmp_path, "hipcc", 'case "$1" in --version) echo "HIP version: 9.9.9"; '
                   'exit 0;; esac\necho "clang: error: cannot find ROCm device library for '
                   'gfx90a" >&2\nexit 1')
    monkeypatch.setenv("PORTAKERN_HIPCC", exe)
    target = toolchains.get("hip")
    with pytest.raises(ToolchainError) as info:
        target.compile('extern "C" __global__ void k(float* p) {}\n', "gfx90a", None, "k.hip")
    err = info.value
    assert err.command[0] == exe and "cannot find ROCm device library" in str(err)
    assert "fails on a one-line kernel too" in str(err) and "Fix:" in str(err)
    rc, out = _cli(capsys, "resources", "softmax", "--backend", "hip", "--arch", "gfx90a")
    assert rc == 2 and "error: hip gfx90a:" in out, out
    _no_traceback(out)

    located = _failing(tmp_path, "hipcc2", 'case "$1" in --version) echo "HIP version: 9.9.9"; '
                       'exit 0;; esac\nfor a; do last=$a; done\n'
                       'echo "k.hip:1:30: error: use of undeclared identifier" >&2\nexit 1')
    monkeypatch.setenv("PORTAKERN_HIPCC", located)
    got = target.compile('extern "C" __global__ void k(float* p) { q; }\n', "gfx90a", None,
                         "k.hip")
    assert not got.ok and isinstance(got.error("src"), CompileError)


def test_failing_hipcc_toolchain_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = _failing(tmp_path, "hipcc")
    monkeypatch.setenv("PORTAKERN_HIPCC", exe)
    with pytest.raises(ToolchainError) as info:
        toolchains.get("hip").toolchain()
    assert info.value.command == (exe, "--version") and STDERR in str(info.value)


# --- cuobjdump -----------------------------------------------------------------------------
def test_failing_cuobjdump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on PATH (no wheel, no toolkit): the stand-in's failure names its command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = _failing(bin_dir, "cuobjdump")
    monkeypatch.setattr(ptxas, "WHEEL_PACKAGES", {})
    monkeypatch.setattr(ptxas, "SYSTEM_DIRS", ())
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ToolchainError) as info:
        ptxas.cubin_resources(b"\x7fELF not really a cubin")
    err = info.value
    assert err.tool == "cuobjdump" and err.command == (exe, "--dump-resource-usage",
                                                       "kernel.cubin")
    assert STDERR in str(err) and "exit status 1" in str(err) and "Fix:" in str(err)


def test_real_cuobjdump_refusing_a_file() -> None:
    """The wheel's (or the toolkit's) cuobjdump on something that is no cubin."""
    exe = ptxas.find_cuobjdump()
    require_tool(exe, "cuobjdump is not installed", ptxas.CUOBJDUMP_FIX)
    with pytest.raises(ToolchainError) as info:
        ptxas.cubin_resources(b"plain text, no device code\n")
    assert info.value.command[0] == exe and "device code" in str(info.value)


# --- oclgrind ------------------------------------------------------------------------------
@pytest.mark.parametrize("library", ["broken", "missing"])
def test_broken_oclgrind_library_is_named(library: str, tmp_path: Path) -> None:
    """A simulator library that is there but will not load is a ToolchainError naming it and
    the loader's message; one PORTAKERN_OCLGRIND_ICD names but that is not there says so;
    neither is reported as "not installed", and neither prints a traceback. (A child process:
    the OpenCL probe, which loads the library, runs once per process.)"""
    import os
    import subprocess
    import sys

    path = tmp_path / "liboclgrind-rt-icd.so"
    if library == "broken":
        path.write_bytes(b"not a shared object\n")
    code = ("import sys; from portakern.tools.cli import main; "
            "sys.exit(main(['trace', 'softmax', '--shape', 'x=4,8']))")
    env = {**os.environ, "PORTAKERN_OCLGRIND_ICD": str(path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    _no_traceback(out)
    assert "not installed" not in out, out
    if library == "broken":
        assert f"command: dlopen {path}" in out and "Fix:" in out, out
        assert "OSError" in out, out  # the loader's own message
    else:
        assert f"PORTAKERN_OCLGRIND_ICD={path} names no file" in out, out

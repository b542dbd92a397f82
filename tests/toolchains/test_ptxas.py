"""Where ptxas and cuobjdump come from (portakern/toolchains/ptxas.py), and that the figures
``portakern resources --backend cuda`` reads from ``ptxas -v`` are the assembled cubin's own.

Order: $PORTAKERN_PTXAS (ptxas only), the NVIDIA wheels in this interpreter (``pip install
'portakern[cuda]'``: nvidia-cuda-nvcc-cu12, nvidia-cuda-cuobjdump), PATH, beside nvcc,
$CUDA_PATH/$CUDA_HOME, /usr/local/cuda/bin. The stand-in tests build fake wheels and fake
toolkits in a temporary folder; the ``wheel_only`` tests hide every system location and run
the real tools from the wheels, as a machine without a CUDA toolkit would.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from conftest import require_tool

ptxas = importlib.import_module("portakern.toolchains.ptxas")


def _tool(folder: Path, name: str, body: str = "exit 0") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def no_system_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ptxas/cuobjdump but what the test puts there: an empty PATH folder, no CUDA_PATH,
    CUDA_HOME, PORTAKERN_PTXAS, no /usr/local/cuda."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for var in ("CUDA_PATH", "CUDA_HOME", "PORTAKERN_PTXAS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ptxas, "SYSTEM_DIRS", ())
    return empty


def _fake_wheels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[str, str]:
    """A namespace package laid out as the NVIDIA wheels are: pkroot/fakenvidia/cuda_nvcc/bin/
    ptxas and pkroot/fakenvidia/cu13/bin/cuobjdump."""
    root = tmp_path / "site"
    p = _tool(root / "fakenvidia" / "cuda_nvcc" / "bin", "ptxas")
    c = _tool(root / "fakenvidia" / "cu13" / "bin", "cuobjdump")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    monkeypatch.setattr(ptxas, "WHEEL_PACKAGES", {"ptxas": ("fakenvidia.cuda_nvcc",),
                                                  "cuobjdump": ("fakenvidia.cu13",)})
    return p, c


def test_the_wheels_come_before_path_and_the_toolkit(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_system_tools: Path) -> None:
    wheel_ptxas, wheel_cuobjdump = _fake_wheels(monkeypatch, tmp_path)
    _tool(no_system_tools, "ptxas")
    _tool(no_system_tools, "cuobjdump")
    toolkit = tmp_path / "cuda"
    _tool(toolkit / "bin", "ptxas")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    monkeypatch.setattr(ptxas, "SYSTEM_DIRS", (str(toolkit / "bin"),))
    assert ptxas.locate("ptxas") == (wheel_ptxas, "wheel")
    assert ptxas.locate("cuobjdump") == (wheel_cuobjdump, "wheel")


def test_portakern_ptxas_beats_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         no_system_tools: Path) -> None:
    _fake_wheels(monkeypatch, tmp_path)
    mine = _tool(tmp_path / "mine", "my-ptxas")
    monkeypatch.setenv("PORTAKERN_PTXAS", mine)
    assert ptxas.locate("ptxas") == (mine, "PORTAKERN_PTXAS")
    monkeypatch.setenv("PORTAKERN_PTXAS", str(tmp_path / "nothing-here"))
    assert ptxas.find_ptxas() is None
    with pytest.raises(ptxas.BackendUnavailable, match="PORTAKERN_PTXAS=.*names no file"):
        ptxas.require_ptxas()


def test_without_wheels_path_then_the_toolkit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              no_system_tools: Path) -> None:
    monkeypatch.setattr(ptxas, "WHEEL_PACKAGES", {})
    toolkit = tmp_path / "cuda"
    in_toolkit = _tool(toolkit / "bin", "ptxas")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    assert ptxas.locate("ptxas") == (in_toolkit, "$CUDA_PATH")
    on_path = _tool(no_system_tools, "ptxas")
    assert ptxas.locate("ptxas") == (on_path, "PATH")
    monkeypatch.delenv("CUDA_PATH")
    os.remove(on_path)
    system = tmp_path / "usr-local-cuda-bin"
    in_system = _tool(system, "ptxas")
    monkeypatch.setattr(ptxas, "SYSTEM_DIRS", (str(system),))
    assert ptxas.locate("ptxas") == (in_system, str(system))
    monkeypatch.setattr(ptxas, "SYSTEM_DIRS", ())
    assert ptxas.locate("ptxas") is None
    with pytest.raises(ptxas.BackendUnavailable, match="nvidia-cuda-nvcc-cu12"):
        ptxas.require_ptxas()
    with pytest.raises(ptxas.BackendUnavailable, match="nvidia-cuda-cuobjdump"):
        ptxas.require_cuobjdump()


def _need_wheels() -> None:
    """The real tools from the wheels: CI installs portakern[cuda], which brings both."""
    for tool, package in (("ptxas", "nvidia-cuda-nvcc-cu12"),
                          ("cuobjdump", "nvidia-cuda-cuobjdump")):
        require_tool(ptxas.wheel_tool(tool), f"{tool} is not installed from the {package} "
                     "wheel in this interpreter", "pip install 'portakern[cuda]'")
    try:
        from portakern.toolchains import nvrtc

        nvrtc.version()
    except Exception as exc:
        require_tool(None, f"NVRTC cannot be loaded ({exc})", "pip install 'portakern[cuda]'")


def test_resources_work_from_the_wheels_alone(no_system_tools: Path) -> None:
    """A machine with no CUDA toolkit (nothing on PATH, no CUDA_PATH, no /usr/local/cuda):
    the resource report runs the wheel's ptxas, and cuobjdump reads the cubin it writes."""
    _need_wheels()
    from portakern.tools import resources

    assert ptxas.locate("ptxas")[1] == ptxas.locate("cuobjdump")[1] == "wheel"
    (rep,) = resources.measure("softmax", "cuda", "80", "float32")
    assert rep.kernel == "softmax" and rep.registers > 0 and rep.occupancy


@pytest.mark.parametrize("arch", ["80", "90"])
def test_ptxas_report_is_the_cubins_own(arch: str) -> None:
    """What ``ptxas -v`` says (parse_ptxas_log) is what the cubin it wrote holds (cuobjdump):
    registers and stack equal; cuobjdump's SHARED adds what the cubin reserves (sm_90: 1 KiB
    once any shared memory is declared), never less than ptxas's static figure."""
    _need_wheels()
    from portakern.ops import get_op
    from portakern.toolchains import nvrtc
    from portakern.tools import resources

    for op in ("softmax", "matmul", "attention"):
        _, src, _, _ = resources.render(get_op(op), "cuda", "float32")
        cubin, log = ptxas.assemble(nvrtc.compile_source(src, arch, name=f"{op}.cu"), arch)
        said = {k["kernel"]: k for k in ptxas.parse_ptxas_log(log)}
        held = {k["kernel"]: k for k in ptxas.cubin_resources(cubin)}
        assert said and set(said) == set(held), (said, held)
        for name, k in said.items():
            h = held[name]
            assert (h["registers"], h["stack_bytes"]) == (k["registers"], k["stack_bytes"]), \
                (op, name, k, h)
            assert k["shared_bytes"] <= h["shared_bytes"] <= k["shared_bytes"] + 1024, (k, h)


def test_cuobjdump_output_is_parsed() -> None:
    text = """
Resource usage:
 Common:
  GLOBAL:0
 Function softmax:
  REG:32 STACK:0 SHARED:2048 LOCAL:0 CONSTANT[0]:540 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function attention_pack_kv:
  REG:16 STACK:8 SHARED:0 LOCAL:4 CONSTANT[0]:380 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    assert ptxas.parse_cuobjdump_resources(text) == [
        {"kernel": "softmax", "registers": 32, "stack_bytes": 0, "shared_bytes": 2048,
         "local_bytes": 0},
        {"kernel": "attention_pack_kv", "registers": 16, "stack_bytes": 8, "shared_bytes": 0,
         "local_bytes": 4}]

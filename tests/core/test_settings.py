"""portakern.core.settings: every PORTAKERN_* variable declared once and read in one place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from portakern.core import settings

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "portakern").rglob("*.py"))


def test_every_variable_is_declared_and_read_only_through_settings() -> None:
    # names bound to a variable's name (ENV_TUNING = "PORTAKERN_TUNING") count as the name
    aliases = {m for path in SOURCES for m in
               re.findall(r"^\s*([A-Za-z_]\w*)\s*(?::\s*\w+\s*)?=\s*[\"']PORTAKERN_",
                          path.read_text(), re.M)}
    names = "|".join([r"[\"']PORTAKERN_\w+", *(rf"{a}\b" for a in sorted(aliases))])
    read = re.compile(rf"(?:environ\.get|getenv|environ\[)\(?\s*(?:{names})")
    undeclared, direct = set(), []
    for path in SOURCES:
        text = path.read_text()
        undeclared |= set(re.findall(r"PORTAKERN_[A-Z0-9_]+", text)) - set(settings.SETTINGS)
        if path.name != "settings.py":
            direct += [f"{path.name}: {m}" for m in read.findall(text)]
    assert not undeclared, f"not declared in portakern/core/settings.py: {sorted(undeclared)}"
    assert not direct, f"read around portakern.core.settings: {direct}"


@pytest.mark.parametrize("text", ["0", "off", "OFF", " no ", "false", "None"])
def test_off_is_spelled_one_way(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_OPENCL_POOL", text)
    monkeypatch.setenv("PORTAKERN_TUNING", text)
    monkeypatch.setenv("PORTAKERN_CUDA_CACHE", text)
    assert settings.get("PORTAKERN_OPENCL_POOL") is False
    assert settings.get("PORTAKERN_TUNING") == "off"
    assert settings.get("PORTAKERN_CUDA_CACHE") is None


def test_typed_values_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTAKERN_KERNEL_CACHE_SIZE", "7")
    assert settings.get("PORTAKERN_KERNEL_CACHE_SIZE") == 7
    for bad in ("", "  ", "x", "-3", "0"):
        monkeypatch.setenv("PORTAKERN_KERNEL_CACHE_SIZE", bad)
        assert settings.get("PORTAKERN_KERNEL_CACHE_SIZE") == 128
    monkeypatch.setenv("PORTAKERN_TUNING", "Exact")
    assert settings.get("PORTAKERN_TUNING") == "exact"
    monkeypatch.delenv("PORTAKERN_TUNING")
    assert settings.get("PORTAKERN_TUNING") == "nearest"


def test_cache_dir_governs_the_cuda_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                          ) -> None:
    from portakern.backends import cuda

    monkeypatch.setenv("PORTAKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PORTAKERN_CUDA_CACHE", raising=False)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "theirs"))  # set: left alone
    assert cuda._cache_dir() == str(tmp_path / "cuda")

"""No secrets in result files (issue 19): `portakern bench` records an allow-list of
environment variables by exact name, a hash of the machine id and no user name. Planted
secret-looking variables must appear in none of the JSON, the markdown or the plots; the
committed result files are checked too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portakern.backend import registry
from portakern.tools.bench import environment

REPO = Path(__file__).resolve().parents[2]
SECRETS = {
    "TF_TOKEN_app_terraform_io": "s3cret-tf-token-19",
    "TF_VAR_db_password": "s3cret-tf-var-19",
    "AWS_SECRET_ACCESS_KEY": "s3cret-aws-19",
    "GITHUB_TOKEN": "s3cret-gh-19",
    "HF_TOKEN": "s3cret-hf-19",
    "OPENBLAS_API_KEY": "s3cret-prefix-19",  # an allowed prefix, not an allowed name
    "PORTAKERN_PASSWORD": "s3cret-own-prefix-19",
}


def _plant(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")


def _assert_clean(blob: bytes, where: str) -> None:
    for k, v in SECRETS.items():
        assert v.encode() not in blob, f"{k}'s value is in {where}"
        assert k.encode() not in blob, f"{k} is named in {where}"


def test_environment_record_keeps_only_the_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(monkeypatch)
    rec = environment.collect()
    assert rec["env"].get("OMP_NUM_THREADS") == "2"
    assert set(rec["env"]) <= environment.ENV_ALLOW
    assert "user" not in rec
    mid = rec.get("machine_id")
    assert mid is None or (mid.startswith("sha256:") and len(mid) == 23)
    raw = Path("/etc/machine-id")
    if raw.exists() and raw.read_text().strip():
        assert raw.read_text().strip() not in json.dumps(rec)
    _assert_clean(json.dumps(rec).encode(), "the environment record")


def test_bench_files_hold_no_planted_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    av = registry.availability("opencl")
    if not av.available:
        pytest.skip(f"no OpenCL device: {av.reason}")
    from portakern.tools.cli import main

    _plant(monkeypatch)
    out = tmp_path / "res.json"
    plots = tmp_path / "plots"
    rc = main(["bench", "--ops", "softmax", "--limit", "1", "--backends", "opencl:0",
               "--peers", "numpy", "--out", str(out), "--plots", str(plots),
               "--min-time", "0.01", "--min-reps", "2", "--budget", "10"])
    assert rc == 0
    files = [out, out.with_suffix(".md"), *sorted(plots.rglob("*"))]
    assert any(p.suffix == ".png" for p in files)
    for p in files:
        if p.is_file():
            _assert_clean(p.read_bytes(), str(p))


def test_committed_results_hold_no_secret_user_or_raw_machine_id() -> None:
    results = REPO / "benchmarks" / "results"
    for p in sorted(results.rglob("*.json")):
        doc = json.loads(p.read_text())
        env = doc.get("environment", {})
        assert "user" not in env, p
        assert set(env.get("env", {})) <= environment.ENV_ALLOW, p
        mid = env.get("machine_id")
        assert mid is None or str(mid).startswith("sha256:"), p
    for p in [*results.rglob("*.json"), *results.rglob("*.md"), REPO / "REPORT.md"]:
        if p.is_file():
            text = p.read_text(errors="replace")
            assert "TF_CLI_CONFIG_FILE" not in text and "terraformrc" not in text, p

"""The `tessera` command: real subprocesses, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tessera(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tessera.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_validate_ok_and_schema() -> None:
    ok = tessera("validate", "deployments/specs/local-cpu.yaml")
    assert ok.returncode == 0, ok.stderr
    assert "ok: tiny-local" in ok.stdout
    schema = json.loads(tessera("schema").stdout)
    assert schema["title"] == "TrainingSpec"


def test_user_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel: {tp: 3}\ncluster: {chips_per_node: 3}\n")
    result = tessera("validate", str(bad))
    assert result.returncode == 1
    assert "parallel.tp=3 must divide model.n_heads=4" in result.stderr
    assert "Traceback" not in result.stderr
    missing = tessera("validate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "cannot read spec" in missing.stderr


@pytest.mark.slow
def test_missing_data_is_one_line_without_traceback(tmp_path: Path) -> None:
    """`tessera train` checks its dataset before launching any rank; `tessera run` (the pipeline on a
    temporary Prefect server) shows the task's DataError without Prefect's two tracebacks of it."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: missing-data\nmodel: {preset: tiny}\n"
        f"data: {{source: files, paths: ['{tmp_path}/corpus/*.txt']}}\n"
        "train: {steps: 2, seq_len: 32, global_batch_size: 4, micro_batch_size: 2}\n"
        "parallel: {dp_shard: 2}\ncluster: {accelerator: cpu, chip: cpu, nodes: 1, chips_per_node: 2}\n"
    )
    gone = str(tmp_path / "data" / "7707724aff555ed6" / "manifest.json")
    train = tessera("train", str(spec), "--run-dir", str(tmp_path / "manual"), "--data", gone)
    assert (
        train.returncode == 1
        and train.stderr
        == f"error: no dataset card at {gone!r}; run data preparation first (or fix data_url)\n"
    )
    env = {
        **os.environ,
        "TESSERA_RUNS_DIR": str(tmp_path / "runs"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
    }
    run = tessera("run", str(spec), env=env, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in output, output
    assert f"error: data.paths entry '{tmp_path}/corpus/*.txt' matches no files" in run.stderr


def test_run_reports_a_spec_error_before_importing_prefect(tmp_path: Path) -> None:
    """`tessera run` validates first: a typo is reported as quickly as `tessera validate` reports it."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {stpes: 3}\n")
    probe = (
        "import sys; from typer.testing import CliRunner; from tessera.cli import app; "
        f"result = CliRunner().invoke(app, ['run', {str(bad)!r}]); "
        "print(result.exit_code, 'prefect' in sys.modules); print(result.output)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.startswith("1 False\n") and "train.stpes: unknown field" in result.stdout, (
        result.stdout
    )

"""The `tessera` command: real subprocesses, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tessera(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tessera.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
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

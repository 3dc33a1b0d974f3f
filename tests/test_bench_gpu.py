"""``make bench-gpu``'s dry run: the GPU benchmark's whole code path (calibration, the raw disk, the
trainer's own launch timed from outside, the hand-written loop with its checkpoint save and load, the
planner with both profiles, the JSON and the table) on CPU processes, so that it cannot rot between
the rare sessions with a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_gpu import ROWS, Budget, Host, Row, row_devices, skip_reason
from benchmarks.bench_gpu import __file__ as bench_file

REPO = Path(bench_file).parent.parent


@pytest.mark.dist
@pytest.mark.timeout(1500)  # two torchrun launches, a calibration and a checkpoint round trip on CPU
def test_the_dry_run_measures_a_row_beside_its_baselines_and_says_why_it_skips_others(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    rows = "1b-eager,1b-compile-fp8"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_gpu",
        "--dry-run",
        "--out",
        str(out),
        "--work-dir",
        str(work),
    ]
    done = subprocess.run([*cmd, "--rows", rows], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "gpu-dry-run.json").read_text())
    by_name = {row["row"]: row for row in results["rows"]}
    assert list(by_name) == [row.name for row in ROWS]
    eager = by_name["1b-eager"]
    assert "failed" not in eager, eager.get("failed")
    trainer, loop = eager["trainer"], eager["baseline"]
    assert trainer["steps"] == results["steps"] and trainer["tokens_per_s"] > 0
    assert trainer["time_to_first_step_s"] > 0 and trainer["final_save_s"] > 0
    assert trainer["checkpoint_bytes"] > 0 and trainer["peak_memory_bytes"] > 0
    assert loop["tokens_per_s"] > 0 and loop["save_gbps"] > 0 and loop["load_gbps"] > 0
    assert eager["planned_step_catalog_s"] > 0 and eager["planned_step_calibrated_s"] > 0
    for ratio in (
        "trainer_over_loop_tokens_per_s",
        "save_over_raw_write",
        "planned_over_measured_calibrated",
    ):
        assert eager[ratio] > 0
    assert results["raw_disk"]["write_gbps"] > 0 and results["raw_disk"]["read_gbps"] > 0
    assert results["calibration"]["chip"] == "cpu"
    assert by_name["1b-compile-fp8"]["skipped"] == "chip 'cpu' has no fp8 matmul"
    assert by_name["1b-compile"]["skipped"] == "not selected (--rows)"
    table = (out / "gpu-dry-run.md").read_text()
    assert "| 1b-eager | " in table and "no fp8 matmul" in table
    assert not any(work.iterdir())  # every run and checkpoint is removed


def test_rows_that_cannot_run_here_say_why_before_any_time_is_spent() -> None:
    one_gpu = Host("gpu", "h200", 1, False)
    multi = next(row for row in ROWS if row.gpus == 0)
    assert row_devices(multi, one_gpu) == "needs two or more GPUs; this host has 1"
    assert row_devices(multi, Host("gpu", "h200", 8, False)) == 8
    fp8 = Row("fp8", {}, {"float8": "tensorwise"})
    assert skip_reason(fp8, Host("gpu", "a100-80gb", 1, False)) == "chip 'a100-80gb' has no fp8 matmul"


def test_the_deadline_refuses_what_no_longer_fits() -> None:
    budget = Budget(deadline_s=100.0)
    assert budget.refuse(10.0) is None
    assert budget.refuse(1000.0).startswith("deadline: ")
    assert Budget(deadline_s=0.0).refuse(1.0) == "deadline: 0 s left, needs ~1 s"

"""Run comparison (``tessera compare``) and planned vs measured, over run directories as the pipeline
leaves them: ``run.json`` written by ``Run.open``, ``metrics.jsonl`` by the trainer's ``MetricsWriter``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deployments.run import Run, find_run
from tessera.cli import app
from tests.pipeline_specs import tiny_spec
from trainer.metrics import MetricsWriter
from trainer.plan.measured import planned_vs_measured
from trainer.report.compare import RunRecord, outcome_rows, spec_diff
from trainer.rundir import RunDir
from trainer.units import GiB


@pytest.fixture(autouse=True)
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def trained(tmp_path: Path, run_id: str, step_times: list[float], **spec: Any) -> Run:
    """A run whose trainer logged one step per entry of ``step_times`` (loss falling, 0.5 GiB peak)."""
    run = Run.open(tiny_spec(tmp_path, "cmp", **spec), RunDir(tmp_path / "runs" / run_id))
    tokens = run.job.train.global_batch_size * run.job.train.seq_len
    with MetricsWriter(run.dir.metrics, resumed_step=0, enabled=True) as metrics:
        for step, seconds in enumerate(step_times, 1):
            metrics.write(
                {
                    "step": step,
                    "loss": 8.0 / step,
                    "step_time_s": seconds,
                    "tokens_per_s": tokens / seconds,
                    "mfu": run.plan.flops_per_step / (seconds * run.plan.chips * 1e12),
                    "peak_memory_bytes": int(0.5 * GiB) * step // len(step_times),
                }
            )
    return run


def test_planned_vs_measured_skips_the_first_step_and_keeps_the_peak(tmp_path: Path) -> None:
    run = trained(tmp_path, "cmp-0000000a", [5.0, 0.2, 0.4, 0.3])  # step 1 compiles and warms up
    step, mfu, memory, throughput = planned_vs_measured(run.plan, RunRecord.read(run.dir).metrics)
    assert (step.planned, step.measured) == (run.plan.step_time_s, 0.3)
    assert memory.measured == int(0.5 * GiB) and memory.planned == run.plan.memory_per_chip_bytes.total
    assert throughput.measured == pytest.approx(run.plan.tokens_per_step / 0.3)
    assert mfu.planned == run.plan.mfu and mfu.measured == pytest.approx(
        run.plan.flops_per_step / (0.3 * run.plan.chips * 1e12)
    )
    assert step.cells()["measured / planned"] == f"{0.3 / run.plan.step_time_s:.2f}×"
    assert planned_vs_measured(run.plan, [])[0].cells()["measured"] == "-"  # before the first step


def test_compare_diffs_specs_and_outcomes_and_finds_runs_by_any_name(tmp_path: Path, runs_dir: Path) -> None:
    a = trained(tmp_path, "cmp-0000000a", [1.0, 0.2, 0.2])
    b = trained(tmp_path, "cmp-0000000b", [1.0, 0.1, 0.1], optimizer={"lr": 1e-3, "warmup_steps": 1})
    runs = [RunRecord.read(a.dir), RunRecord.read(b.dir)]
    assert spec_diff(runs) == [{"field": "optimizer.lr", "cmp-0000000a": "0.003", "cmp-0000000b": "0.001"}]
    assert [(r["run"], r["step time (s)"], r["final train loss"]) for r in outcome_rows(runs)] == [
        ("cmp-0000000a", "0.200", "2.6667"),
        ("cmp-0000000b", "0.100", "2.6667"),
    ]
    assert find_run("train-cmp-0000000b") == find_run(str(b.dir.path)) == find_run("cmp-0000000b")
    assert find_run("train-cmp-0000000b-continued-1234abcd").path == b.dir.path

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["compare", "cmp-0000000a", "train-cmp-0000000b", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "comparison.png").stat().st_size > 0
    markdown = (out / "comparison.md").read_text()
    assert "| optimizer.lr | 0.003 | 0.001 |" in markdown and "![loss curves](comparison.png)" in markdown
    missing = CliRunner().invoke(app, ["compare", "cmp-0000000a", "nope"])
    assert missing.exit_code == 1 and "no run 'nope'" in missing.output


DAMAGED_LINES = [
    b"\xff\xfe\x00garbage\x80",  # binary: not UTF-8
    b"42",  # JSON, but not a record
    b"{}",  # a record without a step
    b'{"step": 2, "loss": "abc"}',  # a loss that is no number
    b'{"step": 3, "loss": 1.0, "tokens_per_s": [1]}',  # a field of the wrong shape
    b'{"step": 4, "loss": 1.',  # torn by a killed writer
]


def damage(run: Run) -> None:
    """Interleave every kind of damaged line with the run's readable ones."""
    good = run.dir.metrics.read_bytes().splitlines()
    mixed = [line for pair in zip(good, DAMAGED_LINES, strict=False) for line in pair]
    run.dir.metrics.write_bytes(b"\n".join(mixed + good[len(DAMAGED_LINES) :] + DAMAGED_LINES[len(good) :]))


def test_damaged_metrics_lines_are_skipped_counted_and_never_fail_a_comparison(tmp_path: Path) -> None:
    a = trained(tmp_path, "cmp-0000000a", [1.0, 0.2, 0.2])
    trained(tmp_path, "cmp-0000000b", [1.0, 0.1, 0.1])
    damage(a)
    record = RunRecord.read(a.dir)
    assert [m["step"] for m in record.metrics] == [1, 2, 3]
    assert record.skipped == "6 unreadable lines of metrics.jsonl skipped"
    result = CliRunner().invoke(
        app, ["compare", "cmp-0000000a", "cmp-0000000b", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 0, result.output
    assert "cmp-0000000a: 6 unreadable lines of metrics.jsonl skipped (damaged)." in result.output
    assert "cmp-0000000b:" not in result.output.split("Spec differences", 1)[0].split("| MFU |", 1)[1]

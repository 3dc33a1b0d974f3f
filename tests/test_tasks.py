"""Task bodies against a real (in-process) Prefect server: caching, plan artifacts and refusal,
provisioning handles, the retry condition, and the loss curve."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.states import Completed, Failed

from deployments.run import Run
from deployments.spec import SPEC_DIR, load_spec
from tasks.curves import plot_loss_curve
from tasks.data import prepare_dataset_task
from tasks.keys import artifact_key
from tasks.plan import plan_task
from tasks.provision import provision_task, teardown_task
from tasks.report import report_task
from tasks.train import TrainingFailed, already_complete, retry_on_node_failure
from tests.pipeline_specs import tiny_spec
from trainer.checkpoint.commit import CommitRecord, step_dir_name, write_commit
from trainer.data.card import read_card
from trainer.failures import EXIT_PREEMPTED, classify_exit
from trainer.plan.checkpointing import daly_interval_seconds
from trainer.rundir import RunDir
from trainer.runtime.agents import start_agent, stop_agent

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture(autouse=True)
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def artifact(key: str) -> object:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no artifact {key}"
    data = found[0].data
    return json.loads(data) if isinstance(data, str) else data


def test_data_preparation_finds_its_dataset_and_never_returns_a_missing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-run reuses the dataset the store keys by content; after `make clean`, or in a second checkout
    (another working directory, one PREFECT_HOME), it prepares again rather than return a URL to nothing."""
    first_checkout, second_checkout = tmp_path / "first", tmp_path / "second"
    first_checkout.mkdir()
    second_checkout.mkdir()
    spec = tiny_spec(tmp_path, "prep", data={"output_url": "data"})  # relative, as in the demo
    args = (spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)

    monkeypatch.chdir(first_checkout)
    url = prepare_dataset_task(*args)
    manifest = first_checkout / url
    written = manifest.stat().st_mtime_ns
    assert prepare_dataset_task(*args) == url and manifest.stat().st_mtime_ns == written  # reused

    shutil.rmtree(first_checkout / "data")  # make clean
    assert prepare_dataset_task(*args) == url and read_card(str(manifest)).totals["train"].samples > 0

    monkeypatch.chdir(second_checkout)
    assert prepare_dataset_task(*args) == url and read_card(url).totals["train"].samples > 0


def test_plan_publishes_a_table_and_warns_when_oversubscribed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run.open(tiny_spec(tmp_path, "plan-ok"))
    assert plan_task(run).fits
    table = artifact(artifact_key(run.run_id, "plan"))
    rows = {row["quantity"]: row["planned"] for row in table}
    assert rows["fits in HBM"] == "yes" and rows["checkpoint interval"] == "3 steps"
    assert {"memory per chip", "step time", "MFU", "throughput"} <= set(rows)
    assert {row["measured"] for row in table} == {"-"}  # until the run has trained (then the report's)
    big = tiny_spec(tmp_path, "plan-big", model={"preset": "llama3-8b"}, allow_oversubscribe=True)
    assert not plan_task(Run.open(big)).fits
    assert "launching anyway because allow_oversubscribe is set" in caplog.text


def test_job_resolves_checkpoint_url_and_auto_interval(tmp_path: Path, runs_dir: Path) -> None:
    run = Run.open(tiny_spec(tmp_path, "auto", checkpoint={"interval": "auto"}), data_url="file:///d/m.json")
    job, plan = run.job, run.plan
    assert run.dir.path.parent == runs_dir and run.run_id.startswith("auto-")
    assert job.checkpoint.url == str(runs_dir / run.run_id / "checkpoints")
    # Young/Daly: checkpoint every sqrt(2·C·M)-ish seconds of compute, C the blocking write, M the MTBF.
    optimum_s = max(
        daly_interval_seconds(plan.checkpoint_blocking_s, plan.mtbf_hours * 3600), plan.checkpoint_write_s
    )
    assert job.checkpoint_interval_steps == max(1, round(optimum_s / plan.step_time_s))
    assert json.loads(run.dir.job.read_text())["checkpoint_interval_steps"] == job.checkpoint_interval_steps


def test_provision_local_multi_node_and_kubernetes(tmp_path: Path, runs_dir: Path) -> None:
    spec = tiny_spec(tmp_path, "two-nodes", cluster={"nodes": 2, "chips_per_node": 1})
    local = provision_task(Run.open(spec))
    assert local.kind == "local" and len(local.local_commands()) == 2
    assert local.rdzv_endpoint and local.rdzv_endpoint.startswith("127.0.0.1:")
    assert all(f"--rdzv-endpoint={local.rdzv_endpoint}" in command for command in local.local_commands())
    assert local.run.dir.job.exists() and local.run.dir.path.parent == runs_dir
    gpu = load_spec(SPEC_DIR / "gpu-llama3-8b-h100.yaml")
    remote = provision_task(Run.open(gpu, data_url="s3://b/d/manifest.json"))
    assert remote.kind == "kubernetes" and [m["kind"] for m in remote.manifests] == ["ConfigMap", "JobSet"]
    assert (remote.run.dir.manifests / f"{remote.run.run_id}.yaml").exists()


def test_retry_condition_retries_only_node_failures() -> None:
    def decide(state: object) -> bool:
        return retry_on_node_failure(None, None, state)  # type: ignore[arg-type]

    assert decide(Failed(data=TrainingFailed("node_failure", -9, "exitcode  : -9 (pid: 1)")))
    assert decide(
        Failed(data=TrainingFailed("preempted", EXIT_PREEMPTED, "preempted (SIGTERM) after step 7"))
    )
    assert not decide(Failed(data=TrainingFailed("user_error", 3, "loss is NaN")))
    assert not decide(Failed(data=ValueError("a bug")))
    assert not decide(Completed(data="s3://ckpt"))
    root_cause = f"Root Cause (first observed failure):\n  exitcode  : {EXIT_PREEMPTED} (pid: 1)\n====="
    assert classify_exit(1, root_cause) == "preempted"


def test_loss_curve_is_a_png(tmp_path: Path) -> None:
    """The PNG shows what it claims: a falling train line (C0 blue) and the eval points (C1 orange)."""
    metrics = [{"step": s, "loss": 8.0 - 0.1 * s} for s in range(1, 11)]
    evals = [{"step": 5, "loss": 7.6}, {"step": 10, "loss": 7.1}]
    path = plot_loss_curve(metrics, evals, tmp_path / "loss.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = (matplotlib.image.imread(path)[..., :3] * 255).round()

    def where(rgb: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        rows, cols = np.nonzero((np.abs(pixels - rgb) < 40).all(axis=-1))
        return rows, cols

    rows, cols = where((31, 119, 180))  # the train line
    assert cols.max() - cols.min() > pixels.shape[1] / 2, "the train line spans the plot"
    left, right = rows[cols < np.percentile(cols, 25)], rows[cols > np.percentile(cols, 75)]
    assert np.median(left) < np.median(right), "the loss falls: the line goes down to the right"
    eval_rows, eval_cols = where((255, 127, 14))  # the eval markers and the line between them
    assert len(eval_cols) > 50 and np.median(eval_cols) > np.median(cols), "evals sit at steps 5 and 10"
    early = eval_cols < np.median(eval_cols)
    assert np.median(eval_rows[early]) < np.median(eval_rows[~early]), "eval loss falls from 7.6 to 7.1"


def test_teardown_stops_agents_a_cancelled_train_task_left_running(tmp_path: Path, runs_dir: Path) -> None:
    target = provision_task(Run.open(tiny_spec(tmp_path, "teardown")))
    run_dir = target.run.dir
    # A real process shaped like a torchrun agent of this run (argv names the launcher and the run dir).
    agent = start_agent(
        [sys.executable, "-c", "import time; time.sleep(600)", "torch.distributed.run", str(run_dir.path)],
        dict(os.environ),
        run_dir,
    )
    stranger = start_agent([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ), run_dir)
    try:
        teardown_task(target)
        assert agent.wait(timeout=20) == -signal.SIGTERM
        assert stranger.poll() is None, "a process that is not this run's agent is left alone"
    finally:
        stop_agent(stranger)
        stop_agent(agent)


def test_a_damaged_metrics_file_never_fails_the_report(tmp_path: Path) -> None:
    """Binary garbage, a bare number, an empty record, a loss that is a string: skipped, counted, reported."""
    run = Run.open(tiny_spec(tmp_path, "damaged"), RunDir(tmp_path / "runs" / "damaged-0000000a"))
    run.dir.metrics.parent.mkdir(parents=True, exist_ok=True)
    run.dir.metrics.write_bytes(
        b'\xff\xfe\x80\n42\n{}\n{"step": 1, "loss": "abc"}\n{"step": 2, "loss": 5.5, "tokens_per_s": 10.0}\n'
    )
    markdown = report_task.fn(run, "file:///final", [], [])
    assert "Final step 2: train loss 5.5000" in markdown
    assert "**4 unreadable lines of metrics.jsonl skipped** (damaged)." in markdown


def test_a_run_already_trained_to_its_steps_launches_nothing_and_says_so(tmp_path: Path) -> None:
    run = Run.open(tiny_spec(tmp_path, "done", steps=6))
    for step in (3, 6):
        assert already_complete(run) is None  # nothing, then step 3 of 6: train
        manifest = CommitRecord(step=step, tokens=0, model_fingerprint="-", world_size=2, layout={}, files={})
        write_commit(f"{run.checkpoint_url}/{step_dir_name(step)}", manifest)
    state = already_complete(run)
    assert state is not None and state.is_completed()
    assert state.message.startswith(f"run {run.run_id} was already complete at step 6: trained 0 steps")

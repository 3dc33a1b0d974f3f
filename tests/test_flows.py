"""The pipeline flow in-process against a real Prefect server and real torchrun workers: a worker
SIGKILLed mid-training is retried as a node failure and the run completes with every artifact (and
every port it opened was on loopback); a NaN loss is a user error and is not retried; a crash on every
attempt exhausts the retry budget and fails with a summary; catch-up evaluation picks up what was missed."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, get_args
from uuid import UUID

import pytest
from prefect import flow, get_client, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import Artifact, TaskRun
from prefect.futures import wait

from deployments.run import Run, TrainedRun, new_run_id
from flows.pipeline import Evaluation, completed, evaluate_checkpoints, submit_evaluations, train_pipeline
from tasks.keys import ArtifactKind, artifact_key
from tests.fault_report import FaultRow, record
from tests.pipeline_specs import run_of, tiny_spec
from tests.sockets import ListenerSampler
from trainer.checkpoint.commit import CommitRecord, list_checkpoints, step_dir_name, write_commit
from trainer.checkpoint.pins import pin, pinned_steps
from trainer.metrics import read_metrics
from trainer.runtime.agents import worker_pid

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.dist]


@pytest.fixture(autouse=True)
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path / "runs"


def _argv(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def training_workers(run_dir: Path) -> list[int]:
    """pids of torchrun's workers in ``run_dir``: children of a torchrun agent (not data-loader workers);
    each is the rank, or its fork client (``worker_pid`` finds the rank)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        argv = _argv(proc.name)
        if b"trainer.train" not in argv or str(run_dir).encode() not in argv:
            continue
        try:
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if b"torch.distributed.run" in _argv(parent) and b"torch.distributed.run" not in argv:
            pids.append(int(proc.name))
    return pids


class Killer(threading.Thread):
    """SIGKILLs one training worker once the run of ``name`` has logged ``step`` (after a committed
    checkpoint); ``killed_at`` is the wall-clock time of the kill, for the reliability report.

    The ranks hold before ``step + 1`` until the kill is done (the fault injector's hold, set in the
    test's environment), so the kill lands at ``step`` however fast the steps run: on a quiet box a
    poll-then-kill race lost to a run that had already committed its next checkpoint."""

    def __init__(self, runs_dir: Path, name: str, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(daemon=True)
        self.runs_dir, self.name, self.step = runs_dir, name, step
        self.released = runs_dir.parent / f"{name}-killed"  # beside the runs, not one of them
        monkeypatch.setenv("TESSERA_FAULT_HOLD_AT_STEP", str(step + 1))
        monkeypatch.setenv("TESSERA_FAULT_HOLD_UNTIL", str(self.released))
        self.killed_at: float | None = None
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            run_dir = run_of(self.runs_dir, self.name)  # the flow names its run once it starts
            if run_dir is None:
                time.sleep(0.05)
                continue
            records = read_metrics(run_dir.metrics)
            workers = training_workers(run_dir.path)
            if records and records[-1]["step"] >= self.step and workers:
                os.kill(
                    worker_pid(workers[-1]), signal.SIGKILL
                )  # the rank, even when forked by a fork server
                self.killed_at = time.time()
                self.released.touch()  # the retried attempt holds at no step
                return
            time.sleep(0.05)


def task_runs(flow_run_id: UUID) -> dict[str, TaskRun]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run for run in runs}


def train_task_run(flow_run_id: UUID) -> TaskRun:
    return next(run for name, run in task_runs(flow_run_id).items() if name.startswith("train"))


def artifacts_of(run_id: str) -> list[Artifact]:
    """Every version of every artifact of the run ``run_id`` (``like_`` matches anywhere in a key)."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_=f"{run_id}-"))
        )
    return [a for a in found if a.key and a.key.startswith(f"{run_id}-")]


def test_every_artifact_key_of_the_longest_run_id_is_one_prefect_accepts() -> None:
    run_id = new_run_id("a" * 48)  # the longest spec name deployments.spec.NAME_PATTERN allows
    keys = [artifact_key(run_id, kind) for kind in get_args(ArtifactKind)]
    for key in keys:
        create_markdown_artifact("-", key=key)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
    assert {a.key for a in found} == set(keys) and max(len(k) for k in keys) == 68


@pytest.mark.fault
@pytest.mark.cold  # the loopback check samples this process's tree: ranks must be in it
def test_killed_worker_is_retried_and_the_run_completes_with_all_artifacts(
    tmp_path: Path, runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tiny_spec(
        tmp_path, "flow-fault", steps=12, interval=4, faults={"max_restarts": 0, "node_failure_retries": 1}
    )  # no in-job restart: the task retries
    killer = Killer(runs_dir, spec.name, step=5, monkeypatch=monkeypatch)
    with ListenerSampler(os.getpid()) as sampler:
        state = train_pipeline(spec, return_state=True)
    killer.join(timeout=1)
    assert state.is_completed(), state.message
    assert killer.killed_at is not None
    run = run_of(runs_dir, spec.name)
    assert run is not None and run.run_id == f"{spec.name}-{state.state_details.flow_run_id.hex[-8:]}"

    # Every port the run listened on (Prefect's server, gloo, loader workers) is on loopback, except
    # torchrun's rendezvous store: torch 2.13's TCPStore binds all interfaces and has no option not to.
    assert any("prefect.server" in s.argv for s in sampler.seen) and any(
        "trainer.train" in s.argv for s in sampler.seen
    )
    exposed = {s for s in sampler.seen if not s.loopback}
    assert all("torch.distributed.run" in s.argv for s in exposed), exposed

    train = train_task_run(state.state_details.flow_run_id)
    assert train.run_count == 2, "the killed attempt was retried once"
    metrics = read_metrics(run.metrics)
    assert [r["step"] for r in metrics] == list(range(1, 13))  # resumed, no dupes
    (failed,) = [json.loads(line) for line in run.attempts.read_text().splitlines()]
    assert (failed["kind"], failed["checkpoint_step"]) == ("node_failure", 4)
    first_resumed = next(r for r in metrics if r["time"] > killer.killed_at)
    assert first_resumed["step"] == 5
    record(
        FaultRow(
            "kill -9 of a worker, no in-job restart (the Prefect task retries)",
            "recovered",
            failed["kind"],
            round(failed["at"] - killer.killed_at, 1),
            failed["last_step"] - failed["checkpoint_step"],
            round(first_resumed["time"] - killer.killed_at, 1),  # includes Prefect's retry and relaunch
            None,  # compared bitwise in tests/test_train.py; here the flow's artifacts are the subject
        )
    )

    checkpoints = list_checkpoints(str(run.checkpoints))
    assert [(m.step, m.status) for m in checkpoints] == [
        (4, "validated"),
        (8, "validated"),
        (12, "validated"),
    ]
    assert state.result() == TrainedRun(run.run_id, str(run.path.resolve()), checkpoints[-1].url)
    evals = [json.loads(p.read_text()) for p in sorted(run.evals.glob("*.json"))]
    assert [e["step"] for e in evals] == [4, 8, 12] and all(e["perplexity"] > 1 for e in evals)
    assert run.loss_curve.stat().st_size > 0 and "| 12 | validated |" in run.report.read_text()
    # Planned beside measured, and step lines in the run's logs as it trained.
    assert re.search(r"\| step time \| [\d.]+ s \| [\d.]+ s \| [\d.]+× \|", run.report.read_text())
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    assert any(log.message.startswith("step 12/12 · loss ") for log in logs)
    assert {a.key for a in artifacts_of(run.run_id)} == {
        artifact_key(run.run_id, k)
        for k in ("plan", "memory", "progress", "eval", "loss-curve", "failures", "report", "goodput")
    }
    # Where the wall time went: the kill cost one restart; each launch waited for its first process.
    goodput = run.report.read_text().split("## Goodput", 1)[1]
    assert "1 restart(s)" in goodput and not re.search(r"waiting for capacity .*\| 0\.0 \|", goodput)

    run.eval_record(8).unlink()
    assert [e["step"] for e in evaluate_checkpoints(spec)] == [8]  # only the missing evaluation is redone


@pytest.mark.fault
def test_nan_loss_is_a_user_error_and_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_FAULT_NAN_AT_STEP", "2")
    spec = tiny_spec(tmp_path, "flow-nan", steps=4, faults={"node_failure_retries": 2, "max_restarts": 0})
    state = train_pipeline(spec, return_state=True)
    assert state.is_failed()
    train = train_task_run(state.state_details.flow_run_id)
    assert train.run_count == 1 and train.state.is_failed()
    assert "user_error" in train.state.message
    record(FaultRow("NaN loss (flow: not retried)", "failed clearly", "user_error", None, None, None, None))


@pytest.mark.fault
def test_a_fault_on_every_attempt_exhausts_the_retries_and_fails_with_a_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each retry is a fresh torchrun, so the crash hook fires again: node failures with no end.
    monkeypatch.setenv("TESSERA_FAULT_CRASH_AT_STEP", "4")
    spec = tiny_spec(
        tmp_path, "flow-exhausted", steps=6, interval=2, faults={"max_restarts": 0, "node_failure_retries": 1}
    )
    state = train_pipeline(spec, return_state=True)
    assert state.is_failed()
    train = train_task_run(state.state_details.flow_run_id)
    assert train.run_count == 2, "one try plus the one retry the budget allows, then no more"
    message = train.state.message
    assert (
        "2 failed attempt(s): node_failure (exit -9) at step 3, node_failure (exit -9) at step 3" in message
    )
    assert "2 step(s) lost; last good checkpoint: step 2 (" in message
    record(
        FaultRow(
            "kill -9 on every attempt (retry budget exhausted)",
            "failed clearly",
            "node_failure",
            None,
            int(re.search(r"(\d+) step\(s\) lost", message)[1]),
            None,
            None,
        )
    )


def flow_run_count(flow_run_id: UUID) -> int:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).run_count


@pytest.mark.fault
def test_run_identity_retry_resumes_new_runs_train_resume_is_explicit_and_checked(
    tmp_path: Path, runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume rules of deployments/run.py, each through a real flow run on the Prefect server, and
    the artifact histories they give: one per run."""
    # A retry of the flow run reopens its run and resumes: kill -9 at step 3, no task retry, one flow retry.
    spec = tiny_spec(
        tmp_path, "ident", steps=4, interval=2, faults={"max_restarts": 0, "node_failure_retries": 0}
    )
    killer = Killer(runs_dir, spec.name, step=3, monkeypatch=monkeypatch)
    first = train_pipeline.with_options(retries=1)(spec, return_state=True)
    killer.join(timeout=1)
    assert first.is_completed(), first.message
    assert killer.killed_at is not None and flow_run_count(first.state_details.flow_run_id) == 2
    run = run_of(runs_dir, spec.name)
    assert run is not None
    assert [r["step"] for r in read_metrics(run.metrics)] == [1, 2, 3, 4]
    assert json.loads(run.status.read_text())["resumed_from"] == 2

    # A new flow run of an edited spec (a UI run, a schedule, a second `tessera run`) is a new run: it
    # trains all its steps in its own directory and leaves the first run alone.
    edited = tiny_spec(tmp_path, "ident", steps=6, interval=2)
    second = train_pipeline(edited, return_state=True)
    assert second.is_completed(), second.message
    (fresh,) = [r for r in runs_dir.glob("ident-*") if r != run.path]
    assert fresh.name == f"ident-{second.state_details.flow_run_id.hex[-8:]}"
    assert [r["step"] for r in read_metrics(fresh / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((fresh / "status.json").read_text())["resumed_from"] is None
    assert [r["step"] for r in read_metrics(run.metrics)] == [1, 2, 3, 4]

    # Continuing the first run with a spec that trains differently is refused, naming the field...
    resumed = tiny_spec(tmp_path, "ident", steps=6, interval=2, resume_from=run.run_id)
    refused = train_pipeline(resumed, return_state=True)
    assert refused.is_failed()
    assert f"run {run.run_id} was started with a spec that trains differently: train.steps: 4 → 6" in str(
        refused.message
    ) + str(refused.result(raise_on_failure=False))
    assert not run.metrics.read_text().count('"step": 5')

    # ...and continued, in its own directory, when the user says the change is intended.
    allowed = tiny_spec(
        tmp_path, "ident", steps=6, interval=2, resume_from=run.run_id, allow_changes=["train.steps"]
    )
    continued = train_pipeline(allowed, return_state=True)
    assert continued.is_completed(), continued.message
    assert [r["step"] for r in read_metrics(run.metrics)] == [1, 2, 3, 4, 5, 6]
    assert json.loads(run.status.read_text())["resumed_from"] == 4
    assert len(list(runs_dir.glob("ident-*"))) == 2

    # Each flow run has a name of its own, the run's; a run that follows another is compared with it.
    with get_client(sync_client=True) as client:
        names = [client.read_flow_run(s.state_details.flow_run_id).name for s in (first, second, continued)]
    assert names[:2] == [f"train-{run.run_id}", f"train-{fresh.name}"]
    assert names[2] == f"train-{run.run_id}-continued-{continued.state_details.flow_run_id.hex[-8:]}"

    # Each run has artifact histories of its own: the first run's hold its flow runs' versions (its
    # continuation extends them, so its report has two), the second run's only the second flow run's.
    flow_runs = {fresh.name: (second,), run.run_id: (first, continued)}
    for run_id, states in flow_runs.items():
        versions = artifacts_of(run_id)
        assert {a.key for a in versions} >= {
            artifact_key(run_id, k) for k in ("plan", "report", "comparison")
        }
        assert {a.flow_run_id for a in versions} == {s.state_details.flow_run_id for s in states}
    assert sum(a.key == artifact_key(run.run_id, "report") for a in artifacts_of(run.run_id)) == 2
    comparisons = [a for r in flow_runs for a in artifacts_of(r) if a.key == artifact_key(r, "comparison")]
    assert {a.description for a in comparisons} == {
        f"{fresh.name} against the previous run of ident, {run.run_id}",
        f"{run.run_id} against the previous run of ident, {fresh.name}",
    }

    # Continuing it once more, with nothing left to train, launches nothing and says so in its state
    # (last: its flow run adds versions to the run's artifact histories checked above).
    again = train_pipeline(allowed, return_state=True)
    assert again.is_completed() and "already complete at step 6: trained 0 steps" in str(again.message)
    assert [r["step"] for r in read_metrics(run.metrics)] == [1, 2, 3, 4, 5, 6]


@task
def unreadable_checkpoint(step: int) -> dict[str, Any]:
    raise FileNotFoundError(f"step-{step:06d}/.metadata: deleted under the evaluation")


@task
def evaluated(step: int) -> dict[str, Any]:
    return {"step": step}


def test_an_evaluation_that_could_not_run_is_reported_and_its_pin_dropped(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")

    @flow
    def two_evaluations() -> tuple[list[dict[str, Any]], list[str]]:
        pins = [pin(url, step, "flow-test") for step in (4, 8)]
        futures = [evaluated.submit(4), unreadable_checkpoint.submit(8)]
        return completed([Evaluation(s, p, f) for s, p, f in zip((4, 8), pins, futures, strict=True)])

    results, missed = two_evaluations()
    assert results == [{"step": 4}]
    assert (
        len(missed) == 1 and missed[0].startswith("step 8: ") and "deleted under the evaluation" in missed[0]
    )
    assert pinned_steps(url) == set()


@task
def held_until(release: str) -> None:
    while not Path(release).exists():
        time.sleep(0.05)


@pytest.mark.parametrize("max_concurrent", [1, 2])
def test_evaluations_are_bounded_per_run_and_the_newest_checkpoint_goes_first(
    tmp_path: Path, runs_dir: Path, max_concurrent: int
) -> None:
    """Checkpoints committed while eval.max_concurrent validations run wait; a free slot takes the newest."""
    run = Run.open(tiny_spec(tmp_path, "bounded", eval={"max_concurrent": max_concurrent}))
    for step in (2, 4, 6):
        manifest = CommitRecord(step=step, tokens=0, model_fingerprint="-", world_size=2, layout={}, files={})
        write_commit(f"{run.checkpoint_url}/{step_dir_name(step)}", manifest)
    release = tmp_path / "release"

    @flow
    def watch() -> list[list[int]]:
        seen: set[int] = set()
        running = [Evaluation(0, "", held_until.submit(str(release))) for _ in range(max_concurrent)]
        rounds = [submit_evaluations(run, seen, running=running)]  # every slot busy: all wait
        release.touch()
        wait([e.future for e in running])
        while submitted := submit_evaluations(run, seen, running=running):
            rounds.append(submitted)
            running += submitted
            wait([e.future for e in submitted])
        completed(running[max_concurrent:])  # unpins
        return [[e.step for e in r] for r in rounds]

    expected = {1: [[], [6], [4], [2]], 2: [[], [6, 4], [2]]}
    assert watch() == expected[max_concurrent]

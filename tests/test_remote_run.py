"""Live telemetry through the run's object-store URL, as a Kubernetes run has it (moto's S3 on 127.0.0.1).

A pod's run directory dies with the pod, so rank 0 mirrors ``metrics.jsonl`` to ``JobConfig.run_url``
and the train task follows that copy into the progress artifact and the orchestrator's run directory.
Here two local torchrun agents train with an ``s3://`` run URL: the same trainer and task code a pod
and the orchestrator run, minus Kubernetes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from deployments.run import Run
from tasks.keys import artifact_key
from tasks.provision import provision_task
from tasks.train import Progress, train_task
from tests.pipeline_specs import tiny_spec
from trainer import storage
from trainer.metrics import MetricsWriter, mirror_of, read_metrics

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.store]


def lines(*steps: int) -> bytes:
    return "".join(
        json.dumps({"step": s, "loss": 9.0 - s, "tokens_per_s": 100.0, "step_time_s": 0.1, "mfu": 0.01})
        + "\n"
        for s in steps
    ).encode()


def test_a_restarted_pod_continues_the_curve_the_store_holds(s3_bucket: str, tmp_path: Path) -> None:
    remote = f"{s3_bucket}/mirror-resume/metrics.jsonl"
    storage.write_atomic(remote, lines(1, 2, 3, 4))  # the gang before the restart got to step 4
    fresh_pod = tmp_path / "metrics.jsonl"  # the new pod's run directory is empty
    with MetricsWriter(fresh_pod, resumed_step=2, enabled=True, mirror_url=remote) as writer:
        assert [r["step"] for r in read_metrics(remote)] == [1, 2]  # cut back at once, in the store too
        writer.write({"step": 3, "loss": 6.5, "tokens_per_s": 100.0})
    assert (
        [r["step"] for r in read_metrics(remote)] == [1, 2, 3] == [r["step"] for r in read_metrics(fresh_pod)]
    )


def test_progress_follows_a_remote_file_and_keeps_a_local_copy(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
    run = Run.open(tiny_spec(tmp_path, "remote", steps=4))
    remote = f"{s3_bucket}/progress-copy/metrics.jsonl"
    storage.write_atomic(remote, lines(1, 2))
    progress = Progress(run, remote, logging.getLogger("test"), copy_to=run.dir.metrics)
    progress.update()
    assert progress.seen == 2 and run.dir.metrics.read_bytes() == lines(1, 2)  # the report reads this
    assert run.dir.loss_curve.exists()  # drawn from the copy at the first update


@pytest.mark.dist
def test_two_agents_stream_metrics_through_an_s3_run_url_to_the_progress_artifact(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
    opened = Run.open(tiny_spec(tmp_path, "s3-telemetry", cluster={"nodes": 2, "chips_per_node": 1}))
    run_url = f"{s3_bucket}/s3-telemetry/{opened.run_id}"
    run = replace(opened, job=opened.job.model_copy(update={"run_url": run_url}))
    run.write()  # job.json, which the agents read, now names the run URL
    final = train_task(provision_task(run))
    assert final.endswith("step-000006")
    remote = read_metrics(mirror_of(run.dir.metrics, run_url) or "")
    assert [r["step"] for r in remote] == [1, 2, 3, 4, 5, 6] and remote == read_metrics(run.dir.metrics)
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(run.run_id, "progress")]))
        )
    assert artifact.data == 100.0
    assert artifact.description.startswith(f"step 6/6 · loss {remote[-1]['loss']:.4f}")

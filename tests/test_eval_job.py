"""Evaluation sized for the model: where it runs, the evaluation Job it becomes on a Kubernetes pool,
and that Job applied, followed, read back and deleted.

The client test runs against the FAKE API server of tests/k8s_fake.py (no Kubernetes API server
installs here): it stores objects and cascades deletes; the test itself stands in for the Job
controller and for the evaluation pod (it writes the record the pod's ``trainer.evaluate`` would).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from deployments.eval_job import EvaluationJobFailed, run_eval_job
from deployments.eval_placement import eval_placement
from deployments.kubernetes.render import (
    CHIP_RESOURCE,
    eval_record_url,
    render_eval_manifests,
    render_manifests,
    validate_manifests,
)
from deployments.run import Run
from deployments.spec import SPEC_DIR, TrainingSpec, load_spec
from tasks.plan import plan_rows
from tests.k8s_fake import FakeCluster
from trainer import storage
from trainer.config import JobConfig, ModelConfig
from trainer.failures import EXIT_USER_ERROR
from trainer.plan.params import count_params
from trainer.rundir import RunDir
from trainer.units import GiB

NAMESPACE = "default"
ACCELERATOR_SPECS = ["gpu-llama3-8b-h100", "tpu-llama3-70b-v5p", "trainium-llama3-70b-trn2"]


def run_of(name: str, checkpoint_url: str | None = None) -> Run:
    spec = load_spec(SPEC_DIR / f"{name}.yaml")
    if checkpoint_url is not None:
        spec = spec.model_copy(
            update={"checkpoint": spec.checkpoint.model_copy(update={"url": checkpoint_url})}
        )
    root = Path(tempfile.mkdtemp())
    return Run.open(spec, RunDir(root / f"{spec.name}-0123abcd"), data_url="s3://b/d/manifest.json")


def test_tiny_evaluates_in_the_flow_and_70b_on_the_training_pool() -> None:
    local = eval_placement(TrainingSpec())  # the tiny preset on the CPU pool
    assert local.where == "flow" and "local run" in local.line
    gpu = load_spec(SPEC_DIR / "gpu-llama3-8b-h100.yaml")
    tiny_on_gpu = eval_placement(gpu.model_copy(update={"model": TrainingSpec().model}))
    assert tiny_on_gpu.where == "flow" and tiny_on_gpu.needed_bytes < GiB, tiny_on_gpu.line
    llama70b = gpu.model_copy(update={"model": ModelConfig(preset="llama3-70b")})
    big = eval_placement(llama70b)
    assert big.where == "training_pool"
    assert big.needed_bytes > 4 * count_params(llama70b.model).total  # at least the fp32 weights: 282 GB
    assert big.line.startswith("as a Job on the training pool") and "tessera-gpu" in big.line


def test_the_plan_says_where_evaluation_runs_and_why() -> None:
    run = run_of("tpu-llama3-70b-v5p")
    rows = {row["quantity"]: row["planned"] for row in plan_rows(run, [])}
    assert rows["evaluation"] == eval_placement(run.spec).line
    assert "Job on the training pool" in rows["evaluation"] and "orchestrator pod" in rows["evaluation"]


@pytest.mark.parametrize("name", ACCELERATOR_SPECS)
def test_eval_job_passes_the_schema_and_takes_one_training_node(name: str) -> None:
    run = run_of(name)
    config_map, job = render_eval_manifests(run, 40, f"{run.checkpoint_url}/step-000040")
    validate_manifests([config_map, job])  # core Kubernetes schema, strict
    assert (config_map["kind"], job["kind"]) == ("ConfigMap", "Job")
    training_pod = render_manifests(run)[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    pod = job["spec"]["template"]
    assert "completions" not in job["spec"] and "parallelism" not in job["spec"]  # one pod
    for field in ("nodeSelector", "tolerations"):
        assert pod["spec"][field] == training_pod["spec"][field]
    container, trainer = pod["spec"]["containers"][0], training_pod["spec"]["containers"][0]
    assert container["resources"] == trainer["resources"]  # one node's chips and host memory
    assert container["resources"]["limits"][CHIP_RESOURCE[run.spec.cluster.accelerator]] > 0
    assert container["image"] == run.spec.cluster.image
    args = container["args"]
    assert args[:3] == ["python", "-m", "trainer.evaluate"]
    assert args[args.index("--out") + 1] == eval_record_url(run, 40)
    assert pod["spec"]["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]


def test_a_prompt_is_passed_literally_not_expanded_by_kubernetes() -> None:
    run = run_of("gpu-llama3-8b-h100")
    run = replace(
        run,
        spec=run.spec.model_copy(
            update={"eval": run.spec.eval.model_copy(update={"sample_prompt": "$(HOME) $"})}
        ),
    )
    args = render_eval_manifests(run, 1, "s3://b/step-000001")[1]["spec"]["template"]["spec"]["containers"][
        0
    ]["args"]
    assert args[args.index("--sample-prompt") + 1] == "$$(HOME) $$"


def memory_run(tmp_path: Path) -> Run:
    """The 8B GPU run with its checkpoints (and so its run URL) in fsspec's in-memory store."""
    return run_of("gpu-llama3-8b-h100", f"memory://{tmp_path.name}/checkpoints")


def play_job(
    cluster: FakeCluster, name: str, exit_code: int, record: tuple[str, bytes] | None, log: str = ""
) -> threading.Thread:
    """Once the Job exists: the pod writes its record (if any), then the Job ends with ``exit_code``."""

    def pod() -> None:
        deadline = time.monotonic() + 30
        while ("jobs", NAMESPACE, name) not in cluster.objects and time.monotonic() < deadline:
            time.sleep(0.01)
        if record is not None:
            storage.write_atomic(*record)
        cluster.end_job(NAMESPACE, name, exit_code, log)

    thread = threading.Thread(target=pod, daemon=True)
    thread.start()
    return thread


def test_eval_job_is_applied_followed_read_back_and_deleted(cluster: FakeCluster, tmp_path: Path) -> None:
    run = memory_run(tmp_path)
    step_url = f"{run.checkpoint_url}/step-000040"
    name = render_eval_manifests(run, 40, step_url)[1]["metadata"]["name"]
    record = {
        "step": 40,
        "loss": 2.5,
        "perplexity": 12.18,
        "sample_ids": [1],
        "sample": "def f",
        "url": step_url,
    }
    pod = play_job(cluster, name, 0, (eval_record_url(run, 40), json.dumps(record).encode()))
    assert run_eval_job(run, 40, step_url, poll_s=0.02) == record
    pod.join()
    created = [path for method, path in cluster.requests if method == "POST"]
    assert created == [
        f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs",
        f"/api/v1/namespaces/{NAMESPACE}/configmaps",
    ]
    assert not cluster.objects  # the Job, its ConfigMap and its pod are gone


def test_a_failed_eval_job_raises_its_exit_code_and_log_and_is_deleted(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    run = memory_run(tmp_path)
    step_url = f"{run.checkpoint_url}/step-000040"
    name = render_eval_manifests(run, 40, step_url)[1]["metadata"]["name"]
    pod = play_job(
        cluster, name, EXIT_USER_ERROR, None, log="loading...\nerror: checkpoint holds another model"
    )
    with pytest.raises(
        EvaluationJobFailed, match=f"exit code {EXIT_USER_ERROR}: error: checkpoint holds another model"
    ):
        run_eval_job(run, 40, step_url, poll_s=0.02)
    pod.join()
    assert not cluster.objects


@pytest.mark.slow
def test_the_evaluation_pods_entry_point_exits_as_the_trainer_does_on_a_user_error(tmp_path: Path) -> None:
    """A missing dataset cannot be fixed by a retry: exit 3 and one line, so the Job fails at once."""
    job = tmp_path / "job.json"
    job.write_text(JobConfig(data_url=str(tmp_path / "no-dataset")).model_dump_json())
    done = subprocess.run(
        [
            *(sys.executable, "-m", "trainer.evaluate", "--job", str(job), "--step-url", str(tmp_path / "s")),
            *("--batches", "1", "--sample-prompt", "x", "--sample-tokens", "1", "--out", str(tmp_path / "o")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    assert (
        done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    )

"""Launch training on a provisioned cluster, follow it, and decide whether a failure deserves a retry.

Each attempt starts the same torchrun job, which resumes from the latest committed checkpoint, so a
retry after a node failure loses at most one checkpoint interval. Retries are configured per spec
(``faults.node_failure_retries``, ``faults.retry_delay_s``) with :func:`retry_on_node_failure`,
which lets user errors (bad config, NaN loss, OOM on the first step) fail fast. Every failure
carries the run's history (:mod:`tasks.attempts`), so the attempt that exhausts the budget says
which faults were seen, how many steps they cost and where a new run would resume.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.client.schemas.objects import State, TaskRun

from deployments import kubernetes
from tasks.agents import start_agent, stop_agent
from tasks.attempts import publish, record_failure, summary
from tasks.provision import Cluster
from trainer.checkpoint.manifest import list_checkpoints
from trainer.config import JobConfig
from trainer.failures import FailureKind, classify_exit, worker_exit_code
from trainer.launch import LOG_TAIL_LINES, launch_env, torchrun_command
from trainer.metrics import read_metrics

POLL_S = 1.0
K8S_POLL_S = 10.0


class TrainingFailed(RuntimeError):
    """A training attempt that exited non-zero; ``kind`` (from trainer.failures) drives retries."""

    def __init__(self, kind: FailureKind, exit_code: int, log_tail: str, history: str = "") -> None:
        last = log_tail.strip().splitlines()[-5:]
        super().__init__(
            f"training failed ({kind}, worker exit code {exit_code}){'; ' + history if history else ''}:\n"
            + "\n".join(last)
        )
        self.kind = kind
        self.exit_code = exit_code


def retry_on_node_failure(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect ``retry_condition_fn``: retry only what a fresh attempt can fix."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, TrainingFailed) and error.kind == "node_failure"


class Progress:
    """The run's progress artifact, refreshed from ``metrics.jsonl`` as the trainer appends to it."""

    def __init__(self, metrics_path: Path, total_steps: int, key: str) -> None:
        self.path, self.total, self.seen = metrics_path, total_steps, -1
        self.artifact = create_progress_artifact(0.0, key=key, description="waiting for the first step")

    def update(self) -> None:
        records = read_metrics(self.path)
        if not records or records[-1]["step"] == self.seen:
            return
        last = records[-1]
        self.seen = last["step"]
        slowest = (
            f" · straggler: rank {last['slowest_rank']} ({last['host_time_max_s']:.2f}s host time, "
            f"others {last['host_time_others_median_s']:.2f}s)"
            if last.get("straggler")
            else ""
        )
        update_progress_artifact(
            self.artifact,
            100.0 * last["step"] / self.total,
            description=f"step {last['step']}/{self.total} · loss {last['loss']:.4f} · "
            f"{last['tokens_per_s']:.0f} tokens/s{slowest}",
        )


def _drain(stream: Any, tail: deque[str], log: Callable[[str], None] | None) -> None:
    for line in stream:
        tail.append(line)
        if log is not None:
            log(line.rstrip())


def run_local(cluster: Cluster, job: JobConfig, progress: Progress) -> tuple[int, str]:
    """Run one torchrun agent per simulated node; stream node 0's output into the run logger.

    The first agent to fail decides the outcome and the others are stopped at once (otherwise they
    would wait out the collective timeout). Returns its exit code (0 if all succeeded) and log tail.
    """
    logger = get_run_logger()
    agents: list[tuple[subprocess.Popen[str], deque[str], threading.Thread]] = []
    failed: tuple[subprocess.Popen[str], deque[str], threading.Thread] | None = None
    try:
        for node in range(cluster.nodes):
            cmd = torchrun_command(
                cluster.job_path,
                cluster.run_dir,
                cluster.procs_per_node,
                cluster.nodes,
                node,
                cluster.rdzv_endpoint,
                job.faults.max_restarts,
                run_id=job.name,
            )
            proc = start_agent(cmd, launch_env(job), cluster.run_dir)
            tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
            reader = threading.Thread(
                target=_drain, args=(proc.stdout, tail, logger.info if node == 0 else None), daemon=True
            )
            reader.start()
            agents.append((proc, tail, reader))
        while failed is None and any(proc.poll() is None for proc, _, _ in agents):
            failed = next((agent for agent in agents if agent[0].poll()), None)
            progress.update()
            time.sleep(POLL_S)
        failed = failed or next((agent for agent in agents if agent[0].poll()), None)
        progress.update()
    finally:
        for proc, _, reader in agents:
            stop_agent(proc)
            reader.join(timeout=5)
    if failed is None:
        return 0, ""
    return failed[0].returncode, "".join(failed[1])


def run_kubernetes(cluster: Cluster) -> tuple[int, str]:
    """(Re)submit the training job and wait for it; the failed pod's exit code and log tail on failure."""
    kubernetes.apply_manifests(cluster.manifests)
    while (outcome := kubernetes.job_outcome(cluster.manifests[-1]))[0] == "running":
        time.sleep(K8S_POLL_S)
    _, code, tail = outcome
    return code, tail


@task(name="train", tags=["train"])
def train_task(cluster: Cluster, job: JobConfig) -> str:
    """Train to ``job.train.steps`` on ``cluster``; return the URL of the final committed checkpoint."""
    progress = Progress(cluster.run_dir / "metrics.jsonl", job.train.steps, key=f"{job.name}-progress")
    code, tail = run_local(cluster, job, progress) if cluster.kind == "local" else run_kubernetes(cluster)
    kind = classify_exit(code, tail)
    if kind != "ok":
        exit_code = worker_exit_code(code, tail)
        history = record_failure(cluster.run_dir, job.checkpoint.url, kind, exit_code)
        publish(history, key=f"{job.name}-failures")
        raise TrainingFailed(kind, exit_code, tail, summary(history))
    checkpoints = [m for m in list_checkpoints(job.checkpoint.url) if m.good]
    if not checkpoints:
        raise TrainingFailed(
            "user_error", 0, f"training exited 0 but left no checkpoint under {job.checkpoint.url}"
        )
    return checkpoints[-1].url

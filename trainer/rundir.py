"""The run directory: every file a run leaves, by name, spelled in this one place.

One directory per run, ``<runs root>/<run id>/``. The trainer writes the loss curve and its status
there, the orchestrator its plan, evaluations and report; a retry or a torchrun restart finds them
all again, because the run id (and so the directory) stays the same for the whole run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def runs_root() -> Path:
    """``$TESSERA_RUNS_DIR`` or ``runs/`` under the working directory (the repo root for deployments)."""
    return Path(os.environ.get("TESSERA_RUNS_DIR", "runs")).resolve()


@dataclass(frozen=True)
class RunDir:
    """Named paths of one run directory; creating nothing until something is written."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def record(self) -> Path:
        """``run.json``: the run's identity and the spec it was started with (the resume check reads it)."""
        return self.path / "run.json"

    @property
    def job(self) -> Path:
        """``job.json``: the trainer's resolved job, what ``python -m trainer.train --job`` reads."""
        return self.path / "job.json"

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: one line per logged step, appended by rank 0 (the loss curve)."""
        return self.path / "metrics.jsonl"

    @property
    def status(self) -> Path:
        """``status.json``: written once the last step is checkpointed."""
        return self.path / "status.json"

    @property
    def user_error(self) -> Path:
        """``user_error.json``: a rank's user error, so a torchrun restart does not repeat it."""
        return self.path / "user_error.json"

    @property
    def goodput(self) -> Path:
        """``goodput.jsonl``: where the run's wall time went (trainer intervals, launches; trainer.goodput_log)."""
        return self.path / "goodput.jsonl"

    @property
    def attempts(self) -> Path:
        """``attempts.jsonl``: the failed training attempts across Prefect retries."""
        return self.path / "attempts.jsonl"

    @property
    def stopping(self) -> Path:
        """``stopping``: tear-down has begun (the flow is ending): no train attempt may start or retry."""
        return self.path / "stopping"

    @property
    def agents(self) -> Path:
        """``agents.pid``: the torchrun agents started on this host, so tear-down can stop them."""
        return self.path / "agents.pid"

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint location, when the spec names no ``checkpoint.url``."""
        return self.path / "checkpoints"

    @property
    def compile_cache(self) -> Path:
        """Inductor's cache when ``parallel.compile`` is on and ``TORCHINDUCTOR_CACHE_DIR`` is unset, so a
        retried or resumed run reuses the compiled graphs (``trainer.parallel.compile``)."""
        return self.path / "compile_cache"

    @property
    def evals(self) -> Path:
        return self.path / "evals"

    def eval_record(self, step: int) -> Path:
        return self.evals / f"step-{step:06d}.json"

    @property
    def loss_curve(self) -> Path:
        return self.path / "loss.png"

    @property
    def memory_chart(self) -> Path:
        return self.path / "memory.png"

    @property
    def report(self) -> Path:
        return self.path / "report.md"

    @property
    def manifests(self) -> Path:
        """Rendered Kubernetes manifests of the run's training job."""
        return self.path / "manifests"

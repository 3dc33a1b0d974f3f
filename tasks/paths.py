"""Where a run's files live: a stable directory per spec name, so retries and resumes find it."""

from __future__ import annotations

import os
from pathlib import Path

from deployments.spec import TrainingSpec


def runs_root() -> Path:
    """``$TESSERA_RUNS_DIR`` or ``runs/`` under the working directory (the repo root for deployments)."""
    return Path(os.environ.get("TESSERA_RUNS_DIR", "runs")).resolve()


def run_dir(spec: TrainingSpec) -> Path:
    return runs_root() / spec.name

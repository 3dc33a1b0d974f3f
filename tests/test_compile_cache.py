"""Compiled blocks: the compile time is counted, and a second process (a retry, a resume) finds the
graphs in the persistent cache instead of compiling them again (real Inductor, on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainer.parallel.compile import CACHE_ENV, compile_seconds, use_compile_cache
from trainer.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]


def test_the_cache_is_the_runs_unless_the_environment_names_a_shared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunDir(tmp_path / "run")
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert use_compile_cache(run.compile_cache) == run.path / "compile_cache"
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv(CACHE_ENV)
    cache_dir()  # what importing torch._dynamo does: torch's default written into the variable
    assert os.environ[CACHE_ENV] != str(run.path / "compile_cache")
    assert use_compile_cache(run.compile_cache) == run.path / "compile_cache"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "shared"))
    assert use_compile_cache(run.compile_cache) == tmp_path / "shared"


def compile_in_a_new_process(cache: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.compile_probe", str(cache)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two real Inductor compiles (C++ codegen): minutes on a loaded 2-core box
def test_a_second_process_reuses_the_compiled_graphs_and_both_count_their_compile_time(
    tmp_path: Path,
) -> None:
    first = compile_in_a_new_process(tmp_path / "cache")
    second = compile_in_a_new_process(tmp_path / "cache")
    assert first["compile_s"] > 0 and second["compile_s"] > 0
    assert first.get("fxgraph_cache_miss", 0) >= 2, first  # the forward and the backward graph
    assert second.get("fxgraph_cache_miss", 0) == 0, second
    assert second.get("fxgraph_cache_hit", 0) + second.get("autograd_cache_hit", 0) >= 2, second
    assert second.get("autograd_cache_bypass", 0) == 0, second  # the whole block's graph is cacheable


def test_a_compiled_runs_metrics_carry_the_compile_seconds(tmp_path: Path) -> None:
    import torch

    from deployments.spec import TrainingSpec
    from trainer.job import resolve_job
    from trainer.train import StepTelemetry

    spec = TrainingSpec.model_validate({"name": "compile-metrics", "model": {"preset": "tiny"}})
    job = resolve_job(spec.job_config(None), RunDir(tmp_path))
    compiled = job.model_copy(update={"parallel": job.parallel.model_copy(update={"compile": True})})
    cpu = torch.device("cpu")
    eager_line = StepTelemetry(job, cpu, rank=1).record(1, 2.0, 1e-3, 1.0, 0.5, [])
    compiled_line = StepTelemetry(compiled, cpu, rank=1).record(1, 2.0, 1e-3, 1.0, 0.5, [])
    assert "compile_s" not in eager_line and compiled_line["compile_s"] == compile_seconds()

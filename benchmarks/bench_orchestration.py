"""Fixed overhead of the Prefect pipeline over calling the same library functions directly.

Both sides run the same tiny spec end to end on fresh directories: prepare data, plan, train under
torchrun (2 CPU processes), validate and evaluate every checkpoint, report. The pipeline adds task
runs, artifacts, log streaming and the checkpoint watcher; its validation overlaps training, the
direct baseline's does not. The Prefect server (in-process, started once) is measured separately.

- ``overhead_s``: pipeline wall time − direct wall time. Goal ≤ 5 s.
- ``pipeline_vs_direct``: the ratio of the two wall times.

Run: ``python -m benchmarks.bench_orchestration`` (writes benchmarks/results/orchestration.json).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import Goal, Headline, main
from deployments.spec import SPEC_DIR, TrainingSpec, parse_spec

STEPS = 6
INTERVAL = 3
HEADLINE = Headline(
    ratio="pipeline_vs_direct",
    baseline="the same library calls without Prefect (wall time)",
    goal=Goal("overhead_s", "<=", 5),
)


def tiny_spec(root: Path, name: str) -> TrainingSpec:
    data = yaml.safe_load((SPEC_DIR / "local-cpu.yaml").read_text())
    data.update(name=name, eval={"batches": 2, "sample_tokens": 4, "poll_interval_s": 0.5})
    data["data"] = {"source": "generated", "output_url": str(root / "data"), "max_documents": 200}
    data["train"] = {
        **data["train"],
        "steps": STEPS,
        "seq_len": 32,
        "global_batch_size": 4,
        "micro_batch_size": 2,
    }
    data["checkpoint"] = {"interval": INTERVAL, "mode": "sync"}
    return parse_spec(data)


def direct(spec: TrainingSpec) -> float:
    """The pipeline's library calls in sequence, without Prefect."""
    from deployments.run import Run
    from trainer.checkpoint.commit import list_checkpoints
    from trainer.checkpoint.validate import validate_checkpoint
    from trainer.data.loader import load_tokenizer, validation_batches
    from trainer.data.prepare import prepare_dataset
    from trainer.evaluate import evaluate_checkpoint

    start = time.perf_counter()
    data_url = prepare_dataset(spec.data, spec.model.vocab_size, spec.train.seq_len, spec.seed)
    run = Run.open(spec, data_url=data_url)
    job = run.job
    assert job.checkpoint.url is not None and run.plan.fits
    assert run.launch_local().kind == "ok"
    tokenizer = load_tokenizer(data_url)
    for manifest in list_checkpoints(job.checkpoint.url):
        assert validate_checkpoint(manifest.url, job).ok
        evaluate_checkpoint(
            manifest.url,
            job,
            validation_batches(data_url, job.train.micro_batch_size, spec.eval.batches),
            tokenizer.encode(spec.eval.sample_prompt).ids,
            spec.eval.sample_tokens,
        )
    return time.perf_counter() - start


def pipeline(spec: TrainingSpec) -> float:
    from flows.pipeline import train_pipeline

    start = time.perf_counter()
    assert train_pipeline(spec, return_state=True).is_completed()
    return time.perf_counter() - start


def run() -> dict[str, float]:
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
    from prefect.testing.utilities import prefect_test_harness

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["TESSERA_RUNS_DIR"] = str(root / "runs")
        server_start = time.perf_counter()
        with prefect_test_harness(server_startup_timeout=120):
            server_s = time.perf_counter() - server_start
            direct_s = direct(tiny_spec(root / "direct", "bench-direct"))
            pipeline_s = pipeline(tiny_spec(root / "pipeline", "bench-pipeline"))
    return {
        "direct_s": round(direct_s, 2),
        "pipeline_s": round(pipeline_s, 2),
        "overhead_s": round(pipeline_s - direct_s, 2),
        "pipeline_vs_direct": round(pipeline_s / direct_s, 3),
        "server_start_s": round(server_s, 2),
        "steps": STEPS,
        "checkpoints": STEPS // INTERVAL,
    }


if __name__ == "__main__":
    main("orchestration", run)

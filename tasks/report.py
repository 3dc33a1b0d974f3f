"""The run's final report: plan, loss, checkpoints and evaluations in one markdown artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from deployments.spec import TrainingSpec
from trainer.checkpoint.manifest import list_checkpoints
from trainer.config import JobConfig
from trainer.metrics import read_metrics
from trainer.plan import Plan

GiB = 2**30


def report_markdown(
    spec: TrainingSpec,
    plan: Plan,
    job: JobConfig,
    final_url: str,
    metrics: list[dict[str, Any]],
    evals: list[dict[str, Any]],
) -> str:
    last = metrics[-1] if metrics else {}
    lines = [
        f"# {spec.name}: {spec.model.preset} on {spec.cluster.world_size} × {spec.cluster.chip}",
        "",
        "| plan | value |",
        "|---|---|",
        f"| memory per chip | {plan.memory_per_chip_bytes.total / GiB:.2f} GiB |",
        f"| step time (planned) | {plan.step_time_s:.3f} s |",
        f"| MFU (planned) | {plan.mfu:.1%} |",
        f"| checkpoint interval | {job.checkpoint_interval_steps} steps |",
        "",
        f"Final step {last.get('step', '-')}: train loss {last.get('loss', float('nan')):.4f}, "
        f"{last.get('tokens_per_s', 0):.0f} tokens/s. Final checkpoint: `{final_url}`",
        "",
        "| checkpoint | step | status |",
        "|---|---|---|",
        *(f"| `{m.url}` | {m.step} | {m.status} |" for m in list_checkpoints(job.checkpoint.url)),
        "",
        "| eval step | loss | perplexity | sample |",
        "|---|---|---|---|",
        *(f"| {e['step']} | {e['loss']:.4f} | {e['perplexity']:.2f} | `{e['sample']!r}` |" for e in evals),
    ]
    return "\n".join(lines)


@task(name="report", tags=["report"])
def report_task(
    spec: TrainingSpec, plan: Plan, job: JobConfig, final_url: str, run_dir: Path, evals: list[dict[str, Any]]
) -> str:
    markdown = report_markdown(spec, plan, job, final_url, read_metrics(run_dir / "metrics.jsonl"), evals)
    create_markdown_artifact(
        markdown, key=f"{spec.name}-report", description=f"Training report for {spec.name}"
    )
    (run_dir / "report.md").write_text(markdown + "\n")
    return markdown

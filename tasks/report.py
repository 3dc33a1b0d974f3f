"""The run's final report: planned vs measured, loss, checkpoints and evaluations in one markdown artifact."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from deployments.run import Run
from tasks.compare import publish_comparison
from tasks.goodput import publish_goodput
from tasks.keys import artifact_key
from tasks.plan import plan_rows, publish_plan
from trainer.checkpoint.commit import list_checkpoints
from trainer.metrics import JsonLines, load_metrics
from trainer.plan.measured import markdown_table


def report_markdown(
    run: Run,
    final_url: str,
    lines_read: JsonLines,
    evals: list[dict[str, Any]],
    missed: Sequence[str] = (),
) -> str:
    spec, metrics = run.spec, lines_read.records
    last = metrics[-1] if metrics else {}
    lines = [
        f"# {run.run_id}: {spec.model.preset} on {spec.cluster.world_size} × {spec.cluster.chip}",
        "",
        "Planned vs measured (median of the logged steps after the first; memory: the highest peak):",
        "",
        *markdown_table(plan_rows(run, metrics)),
        "",
        f"Final step {last.get('step', '-')}: train loss {last.get('loss', float('nan')):.4f}, "
        f"{last.get('tokens_per_s', 0):.0f} tokens/s. Final checkpoint: `{final_url}`",
        "",
        *(
            [f"**{skipped}** (damaged).", ""]
            if (skipped := lines_read.skipped_note(run.dir.metrics.name))
            else []
        ),
        *(
            ["Tokens per source: " + ", ".join(f"{k} {v:,}" for k, v in last["tokens_by_source"].items()), ""]
            if last.get("tokens_by_source")
            else []
        ),
        "| checkpoint | step | status |",
        "|---|---|---|",
        *(f"| `{m.url}` | {m.step} | {m.status} |" for m in list_checkpoints(run.checkpoint_url)),
        "",
        "| eval step | loss | perplexity | sample |",
        "|---|---|---|---|",
        *(f"| {e['step']} | {e['loss']:.4f} | {e['perplexity']:.2f} | `{e['sample']!r}` |" for e in evals),
    ]
    if missed:
        lines += ["", "**Evaluations that could not run:**", "", *(f"- {line}" for line in missed)]
    return "\n".join(lines)


@task(name="report")
def report_task(run: Run, final_url: str, evals: list[dict[str, Any]], missed: list[str]) -> str:
    """The report artifact (and ``report.md``), the plan artifact with measured figures, and a comparison
    with the spec's previous run when there is one."""
    metrics = load_metrics(run.dir.metrics)
    publish_plan(run, metrics.records)  # the plan artifact's new version: planned beside measured
    markdown = report_markdown(run, final_url, metrics, evals, missed) + "\n\n" + publish_goodput(run)
    create_markdown_artifact(
        markdown, key=artifact_key(run.run_id, "report"), description=f"Training report for run {run.run_id}"
    )
    run.dir.report.write_text(markdown + "\n")
    publish_comparison(run)
    return markdown

"""Run comparisons: ``tessera compare`` writes one as a PNG and markdown; the pipeline publishes one
as an artifact when a run follows an earlier run of its spec (a new run, or one that continues)."""

from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from deployments.run import Run
from tasks.curves import inline_png, plot_comparison
from tasks.keys import artifact_key
from trainer.report.compare import RunRecord, comparison_markdown


def write_comparison(runs: list[RunRecord], out: Path) -> tuple[Path, Path]:
    """``comparison.png`` (overlaid loss curves) and ``comparison.md`` (outcomes, spec diff) in ``out``."""
    png = plot_comparison(runs, out / "comparison.png")
    markdown = out / "comparison.md"
    markdown.write_text(comparison_markdown(runs, f"![loss curves]({png.name})") + "\n")
    return png, markdown


def previous_run(run: Run) -> RunRecord | None:
    """The newest other run of the spec that logged steps: what this one is compared with."""
    earlier = [d for d in Run.of_spec(run.spec.name) if d.path != run.dir.path]
    records = [RunRecord.read(d) for d in reversed(earlier)]
    return next((r for r in records if r.metrics), None)


def publish_comparison(run: Run) -> str | None:
    """The ``<run id>-comparison`` artifact of this run against the previous one; None if it is the first.

    Keyed on this run, like its report: the comparison is one of its findings, found from its run page
    or its id, and a continuation redraws it. A spec-wide key would interleave the spec's runs (and
    concurrent ones) in one history, whose latest version would be whichever run reported last.
    """
    before = previous_run(run)
    if before is None:
        return None
    runs = [before, RunRecord.read(run.dir)]
    png = plot_comparison(runs, run.dir.path / "comparison.png")
    markdown = comparison_markdown(runs, inline_png(png, "loss curves"))
    create_markdown_artifact(
        markdown,
        key=artifact_key(run.run_id, "comparison"),
        description=f"{run.run_id} against the previous run of {run.spec.name}, {before.run_id}",
    )
    return markdown

"""Runs side by side: what differs in their specs, and how fast and how well each trained.

``tessera compare RUN_A RUN_B ...`` and the pipeline's comparison artifact (a run against the one of
its spec before it) both read runs from their directories: ``run.json`` (the spec), ``metrics.jsonl``
and ``evals/``. Plain data in, markdown out; the overlaid loss curves are drawn in ``tasks.curves``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainer.metrics import load_metrics
from trainer.plan.measured import markdown_table, median_of, steady
from trainer.rundir import RunDir


@dataclass(frozen=True)
class RunRecord:
    """One run as recorded in its directory."""

    run_id: str
    spec: dict[str, Any]
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    skipped: str = ""  # e.g. "3 unreadable lines of metrics.jsonl skipped"

    @classmethod
    def read(cls, run_dir: RunDir) -> RunRecord:
        metrics = load_metrics(run_dir.metrics)
        return cls(
            run_dir.run_id,
            json.loads(run_dir.record.read_text())["spec"],
            metrics.records,
            [json.loads(p.read_text()) for p in sorted(run_dir.evals.glob("step-*.json"))],
            metrics.skipped_note(run_dir.metrics.name),
        )


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": value}``: how specs are diffed."""
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in leaves(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def spec_diff(runs: list[RunRecord]) -> list[dict[str, str]]:
    """One row per spec field whose value is not the same in every run (the name aside)."""
    flat = [leaves(run.spec) for run in runs]
    fields = sorted(set().union(*flat) - {"name"})
    return [
        {
            "field": field,
            **{run.run_id: json.dumps(values.get(field)) for run, values in zip(runs, flat, strict=True)},
        }
        for field in fields
        if len({json.dumps(values.get(field)) for values in flat}) > 1
    ]


def _figure(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def outcome_rows(runs: list[RunRecord]) -> list[dict[str, str]]:
    """Steps, final losses and throughput of each run (medians over the logged steps after the first)."""
    rows = []
    for run in runs:
        last, trained = (run.metrics[-1] if run.metrics else {}), steady(run.metrics)
        rows.append(
            {
                "run": run.run_id,
                "steps": str(last.get("step", 0)),
                "final train loss": _figure(last.get("loss"), ".4f"),
                "final eval loss": _figure(run.evals[-1]["loss"] if run.evals else None, ".4f"),
                "step time (s)": _figure(median_of(trained, "step_time_s"), ".3f"),
                "tokens/s": _figure(median_of(trained, "tokens_per_s"), ",.0f"),
                "MFU": _figure(median_of(trained, "mfu"), ".1%"),
            }
        )
    return rows


def comparison_markdown(runs: list[RunRecord], curves: str) -> str:
    """The comparison as markdown; ``curves`` is the markdown that shows the overlaid loss curves."""
    diff = spec_diff(runs)
    return "\n".join(
        [
            f"# {' vs '.join(run.run_id for run in runs)}",
            "",
            curves,
            "",
            *markdown_table(outcome_rows(runs)),
            "",
            *(f"{run.run_id}: {run.skipped} (damaged).\n" for run in runs if run.skipped),
            "Spec differences:" if diff else "The specs are the same (the name aside).",
            "",
            *(markdown_table(diff) if diff else []),
        ]
    )

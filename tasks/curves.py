"""Loss curves as PNGs: one run's training loss against its evaluation loss per checkpoint, and
several runs overlaid for a comparison."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from trainer.report.compare import RunRecord
from trainer.report.figures import png_figure


def plot_loss_curve(metrics: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> Path:
    with png_figure(path, figsize=(7, 4)) as (_, ax):
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train", linewidth=1)
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="eval (held-out)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.grid(alpha=0.3)
        ax.legend()
    return path


def plot_comparison(runs: list[RunRecord], path: Path) -> Path:
    """Each run's training loss (a line) and evaluation loss (dots on the same colour) on one axis."""
    with png_figure(path, figsize=(8, 4.5)) as (_, ax):
        for run in runs:
            (line,) = ax.plot([m["step"] for m in run.metrics], [m["loss"] for m in run.metrics], linewidth=1)
            line.set_label(run.run_id)
            ax.plot(
                [e["step"] for e in run.evals], [e["loss"] for e in run.evals], "o", color=line.get_color()
            )
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss (line: train, dots: held-out)")
        ax.grid(alpha=0.3)
        ax.legend()
    return path


def inline_png(path: Path, alt: str) -> str:
    """Markdown showing the PNG itself (Prefect artifacts cannot link to files on a worker), then its path."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})\n\n`{path}`"

"""The loss curve: training loss per step against evaluation loss per checkpoint, as a PNG."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: flow runs have no display
import matplotlib.pyplot as plt


def plot_loss_curve(metrics: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train", linewidth=1)
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="eval (held-out)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def inline_png(path: Path, alt: str) -> str:
    """Markdown showing the PNG itself (Prefect artifacts cannot link to files on a worker), then its path."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})\n\n`{path}`"

"""PNG figures: matplotlib without a display, each figure laid out, saved and always closed.

Imported only by the modules that draw, so the trainer and spec validation never import matplotlib.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: flow runs and CI have no display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure


@contextmanager
def png_figure(path: Path, *grid: int, figsize: tuple[float, float]) -> Iterator[tuple[Figure, Any]]:
    """``plt.subplots(*grid)`` to draw on; written to ``path`` (its folder made) when the block ends."""
    fig, axes = plt.subplots(*grid, figsize=figsize, dpi=100)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)

"""The planner's per-chip memory breakdown as a stacked bar against the chip's HBM, as a PNG.

Kept out of ``trainer.plan``'s namespace so the trainer and spec validation never import matplotlib.
The stack shows the components the planner adds up; the peak marker is its ``total`` (the larger of
the forward/backward and optimizer phases, so it can sit below the full stack). A stack under a tenth
of HBM (the tiny CPU model) is drawn to its own scale, with HBM named in the title instead of drawn.
"""

from __future__ import annotations

from pathlib import Path

from trainer.plan.plan import Plan
from trainer.report.figures import png_figure

COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_temp")


def plot_memory_breakdown(plan: Plan, path: Path) -> Path:
    mem = plan.memory_per_chip_bytes
    stack = sum(getattr(mem, name) for name in COMPONENTS)
    unit, scale = ("GiB", 2**30) if stack >= 2**30 else ("MiB", 2**20)
    hbm_in_scale = stack >= 0.1 * plan.hbm_bytes
    with png_figure(path, figsize=(8, 5)) as (_, ax):
        bottom = 0.0
        for name in COMPONENTS:
            size = getattr(mem, name) / scale
            ax.bar(0, size, bottom=bottom, width=0.5, label=f"{name.replace('_', ' ')} ({size:,.2f} {unit})")
            bottom += size
        ax.plot(
            [-0.3, 0.3],
            [mem.total / scale] * 2,
            "k-",
            linewidth=2,
            label=f"peak ({mem.total / scale:,.2f} {unit})",
        )
        hbm = f"{plan.chip} HBM ({plan.hbm_bytes / scale:,.0f} {unit})"
        if hbm_in_scale:
            ax.axhline(plan.hbm_bytes / scale, color="red", label=hbm)
            ax.axhline(plan.usable_hbm_bytes / scale, color="red", linestyle="--", label="usable HBM")
        ax.set_ylim(0, max(bottom, plan.hbm_bytes / scale if hbm_in_scale else 0) * 1.1)
        ax.set_xticks([0], [f"{plan.chips} × {plan.chip}"])
        ax.set_xlim(-0.6, 0.6)
        ax.set_ylabel(f"{unit} per chip")
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        off_scale = "" if hbm_in_scale else f" (of {hbm}, off scale)"
        ax.set_title(f"{verdict}{off_scale}: {plan.layout}".replace(" micro", "\nmicro"), fontsize=8)
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    return path

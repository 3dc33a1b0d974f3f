"""Simulated goodput as a PNG: training progress over the run, and where the lost time went, per policy.

Kept out of ``trainer.plan``'s namespace, as ``chart.py`` is, so nothing else imports matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from trainer.plan.goodput_sim import CATEGORIES, Result
from trainer.report.figures import png_figure

DAY_S = 86400.0


def plot_goodput(results: dict[str, Result], title: str, path: Path) -> Path:
    """Left: wall time lost so far (wall time − kept steps × step time), each jump a failure. Right: badput
    per policy, by category."""
    with png_figure(path, 1, 2, figsize=(12, 4.5)) as (fig, (progress, badput)):
        for policy, result in results.items():
            days = [t / DAY_S for t, _ in result.trace]
            lost_h = [(t - steps * result.step_s) / 3600 for t, steps in result.trace]
            progress.plot(days, lost_h, label=f"{policy}: {result.effective_training_time:.1%} effective")
        progress.set_xlabel("wall time (days)")
        progress.set_ylabel("wall time lost (hours)")
        progress.legend()
        lost = [c for c in CATEGORIES if c != "productive"]
        names = list(results)
        left = [0.0] * len(names)
        for category in lost:
            shares = [100 * results[n].seconds[category] / results[n].wall_s for n in names]
            if any(shares):
                badput.barh(names, shares, left=left, label=category)
                left = [a + b for a, b in zip(left, shares, strict=True)]
        badput.set_xlabel("% of wall time lost")
        badput.legend(fontsize=8)
        fig.suptitle(title)
    return path

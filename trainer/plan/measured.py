"""Planned vs measured: the planner's step time, MFU, memory and throughput next to the run's own.

Shown in the report and the plan artifact so a user learns how far to trust the plan on their
hardware. Measured figures are the median over logged steps after the first (which pays for
compilation, allocator warm-up and the first data fetch); memory is the highest peak seen.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from trainer.plan import Plan
from trainer.units import GiB


@dataclass(frozen=True)
class Figure:
    """One quantity, planned and (when the run logged it) measured, formatted for a table."""

    quantity: str
    planned: float
    measured: float | None
    unit: str

    def cells(self) -> dict[str, str]:
        shown = {
            "GiB": lambda v: f"{v / GiB:.2f} GiB",
            "%": lambda v: f"{v:.1%}",
            "s": lambda v: f"{v:.3f} s",
        }
        fmt = shown.get(self.unit, lambda v: f"{v:,.0f} {self.unit}")
        return {
            "quantity": self.quantity,
            "planned": fmt(self.planned),
            "measured": "-" if self.measured is None else fmt(self.measured),
            "measured / planned": "-"
            if self.measured is None or not self.planned
            else f"{self.measured / self.planned:.2f}×",
        }


def steady(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logged steps after the first, or the first alone if it is all there is."""
    return records[1:] or records


def median_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def planned_vs_measured(plan: Plan, records: list[dict[str, Any]]) -> list[Figure]:
    """Step time, MFU, memory per chip and tokens/s: the plan's estimate and the run's metrics."""
    run = steady(records)
    peaks = [r["peak_memory_bytes"] for r in records if "peak_memory_bytes" in r]
    return [
        Figure("step time", plan.step_time_s, median_of(run, "step_time_s"), "s"),
        Figure("MFU", plan.mfu, median_of(run, "mfu"), "%"),
        Figure("memory per chip", plan.memory_per_chip_bytes.total, max(peaks) if peaks else None, "GiB"),
        Figure("throughput", plan.tokens_per_second, median_of(run, "tokens_per_s"), "tokens/s"),
    ]


def markdown_table(rows: list[dict[str, str]]) -> list[str]:
    """A list of same-keyed rows as markdown table lines."""
    header = list(rows[0])
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row[h] for h in header) + " |" for row in rows),
    ]

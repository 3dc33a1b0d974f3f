"""What a run shows while it trains, beside the progress bar: a step line every N steps in the run's
logs, stragglers and slow steps flagged in that same line whenever they happen, and the loss curve
redrawn at a bounded rate (a PNG per redraw is an artifact version: at most one per interval).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

SLOW_STEP_RATIO = 3.0  # a step this many times the recent median is called out
RECENT_STEPS = 20  # the window that median is taken over
CURVE_INTERVAL_S = 30.0


def step_line(record: dict[str, Any], total: int, typical_step_s: float | None) -> tuple[int, str]:
    """(logging level, text) for one metrics record: WARNING when a rank lagged or the step was slow."""
    text = (
        f"step {record['step']}/{total} · loss {record['loss']:.4f} · {record['step_time_s']:.3f} s · "
        f"{record['tokens_per_s']:,.0f} tokens/s · MFU {record['mfu']:.1%}"
    )
    problems = []
    if record.get("straggler"):
        problems.append(
            f"straggler: rank {record['slowest_rank']} ({record['host_time_max_s']:.2f} s before its first "
            f"collective, other ranks {record['host_time_others_median_s']:.2f} s)"
        )
    if typical_step_s and record["step_time_s"] > SLOW_STEP_RATIO * typical_step_s:
        problems.append(f"slow step: {record['step_time_s'] / typical_step_s:.1f}× the recent median")
    return (logging.WARNING, " · ".join([text, *problems])) if problems else (logging.INFO, text)


class StepLines:
    """Step lines for newly logged steps: one every ``every`` steps, and every step with a problem."""

    def __init__(self, total: int, every: int) -> None:
        self.total, self.every = total, every
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.last_line = 0

    def lines(self, new: list[dict[str, Any]]) -> list[tuple[int, str]]:
        out = []
        for record in new:
            typical = statistics.median(self.recent) if len(self.recent) >= 3 else None
            level, text = step_line(record, self.total, typical)
            self.recent.append(record["step_time_s"])
            # The first logged step at or past each multiple of ``every``: metrics may skip steps.
            due = record["step"] // self.every > self.last_line // self.every or record["step"] == self.total
            if due or level > logging.INFO:
                out.append((level, text))
            if due:
                self.last_line = record["step"]
        return out


class Every:
    """True at most once per ``interval_s``; the first call is true."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self.last = interval_s, -float("inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True

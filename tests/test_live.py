"""Step lines while a run trains: every N steps, and every straggler or slow step whenever it happens."""

from __future__ import annotations

import logging
from typing import Any

from tasks.live import Every, StepLines


def record(step: int, seconds: float = 0.1, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 5.0,
        "step_time_s": seconds,
        "tokens_per_s": 1000 / seconds,
        "mfu": 0.03,
        **extra,
    }


def test_a_line_every_n_steps_even_when_metrics_skip_steps() -> None:
    lines = StepLines(total=30, every=10)
    logged = lines.lines([record(s) for s in range(3, 31, 3)])  # log_every=3: steps 3, 6, ..., 30
    assert [text.split(" · ")[0] for _, text in logged] == ["step 12/30", "step 21/30", "step 30/30"]
    assert logged[0] == (logging.INFO, "step 12/30 · loss 5.0000 · 0.100 s · 10,000 tokens/s · MFU 3.0%")


def test_stragglers_and_slow_steps_are_warnings_in_the_same_place() -> None:
    lines = StepLines(total=100, every=50)
    straggler = {
        "straggler": True,
        "slowest_rank": 3,
        "host_time_max_s": 0.9,
        "host_time_others_median_s": 0.1,
    }
    logged = lines.lines([record(1), record(2), record(3), record(4, **straggler), record(5, seconds=0.5)])
    assert logged == [
        (
            logging.WARNING,
            "step 4/100 · loss 5.0000 · 0.100 s · 10,000 tokens/s · MFU 3.0% · straggler: rank 3 "
            "(0.90 s before its first collective, other ranks 0.10 s)",
        ),
        (
            logging.WARNING,
            "step 5/100 · loss 5.0000 · 0.500 s · 2,000 tokens/s · MFU 3.0% · slow step: 5.0× the recent median",
        ),
    ]


def test_every_allows_once_per_interval() -> None:
    every = Every(3600)
    assert [every(), every()] == [True, False]
    assert Every(0)() and Every(0)()

"""Rows of the reliability report, recorded by the fault tests from their own measurements.

With ``TESSERA_FAULT_REPORT=PATH`` set (``make faults`` sets it) every recorded row is appended to
PATH as one JSON line; ``python -m benchmarks.faults_report PATH`` renders the table. Unset, rows
are dropped, so the ordinary suite writes nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

REPORT_ENV = "TESSERA_FAULT_REPORT"


@dataclass(frozen=True)
class FaultRow:
    fault: str
    result: Literal["recovered", "failed clearly"]
    classified_as: str  # what trainer.failures made of it: node_failure / user_error
    detected_s: float | None  # fault injected → the failed attempt ended
    steps_lost: int | None  # steps redone after resuming from the newest good checkpoint
    resume_s: float | None  # fault injected → training resumed (a relaunch logged its resume)
    curve_matched: bool | None  # the recovered run's loss curve equals the uninterrupted one


def record(row: FaultRow) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with Path(path).open("a") as rows:
            rows.write(json.dumps(asdict(row)) + "\n")

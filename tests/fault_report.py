"""Rows of the reliability report, recorded by the fault tests from their own measurements.

With ``TESSERA_FAULT_REPORT=PATH`` set (``make faults`` sets it) every recorded row is appended to
PATH as one JSON line; ``python -m benchmarks.faults_report PATH`` renders the table. Unset, rows
are dropped, so the ordinary suite writes nothing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from datetime import datetime
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
    restored_from: Literal["own memory", "peer memory", "storage"] | None = None  # the tier resumed from


def record(row: FaultRow) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with Path(path).open("a") as rows:
            rows.write(json.dumps(asdict(row)) + "\n")


_LOG_TIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank \d+\] [^\n]*?"


def seconds_between(log: str, fault: str, then: str) -> float:
    """Seconds from the trainer's log line containing ``fault`` to the next one containing ``then``
    (the trainer logs ``%(asctime)s [rank N] message``)."""
    start = re.search(_LOG_TIME + re.escape(fault), log)
    assert start, f"no log line with {fault!r}"
    end = re.compile(_LOG_TIME + re.escape(then)).search(log, start.end())
    assert end, f"no log line with {then!r} after {fault!r}"
    stamp = "%Y-%m-%d %H:%M:%S,%f"
    return round((datetime.strptime(end[1], stamp) - datetime.strptime(start[1], stamp)).total_seconds(), 1)

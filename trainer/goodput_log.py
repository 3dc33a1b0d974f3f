"""``goodput.jsonl``: the intervals where a run's wall time went, as the trainer and the train task write them.

Rank 0 appends intervals (:class:`GoodputRecorder`: start-up, restore, spans of steps, checkpoint
stalls); the train task appends ``launch`` lines (:func:`append_event`). :mod:`trainer.report.goodput`
turns the file into a breakdown.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from trainer.metrics import read_json_lines

SPAN_FLUSH_S = 1.0  # at most this much finished-step time is unrecorded when a process is killed: a


# killed attempt's unrecorded steps count as its restart, not as recomputed steps
def process_started_at() -> float:
    """Wall-clock time this process was created: start-up includes the interpreter and torch import."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):  # not Linux: from now on
        return time.time()


def append_event(path: Path, event: dict[str, Any]) -> None:
    """One line, opened in append mode: the train task and the trainer write the file at different times."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(event) + "\n")


class GoodputRecorder:
    """Rank 0's intervals: start-up, restore, spans of consecutive steps, checkpoint stalls, the end.

    Steps are coalesced into spans written at checkpoints, at the end, and every ``SPAN_FLUSH_S``, so a
    long run writes a few lines a minute rather than one per step.
    """

    def __init__(self, path: Path, enabled: bool) -> None:
        self._file: IO[str] | None = None
        self._span: dict[str, Any] | None = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def write(self, kind: str, t0: float, t1: float, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "t0": t0, "t1": t1, **fields}) + "\n")

    def step(self, step: int, t0: float, t1: float) -> None:
        if self._span is None:
            self._span = {"first": step, "t0": t0}
        self._span.update(last=step, t1=t1)
        if t1 - self._span["t0"] >= SPAN_FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self._span is not None:
            span, self._span = self._span, None
            self.write("steps", span.pop("t0"), span.pop("t1"), **span)

    def checkpoint(self, step: int | None, t0: float, t1: float) -> None:
        """A storage save's stall (``step`` None: waiting for the save in flight at the end)."""
        self.flush()
        self.write("checkpoint", t0, t1, step=step)

    def snapshot(self, step: int, t0: float, t1: float) -> None:
        """An in-memory snapshot's stall (``trainer.checkpoint.ram_tier``)."""
        self.flush()
        self.write("snapshot", t0, t1, step=step)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(path: Path) -> list[dict[str, Any]]:
    return read_json_lines(path).records  # the same JSONL rules: no file → none, a damaged line skipped

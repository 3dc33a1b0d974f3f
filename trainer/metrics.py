"""``metrics.jsonl``: one JSON line per logged step, written by rank 0 only.

The file is the run's loss curve. On resume, lines past the resumed step are dropped first (they
came from steps whose checkpoint never committed and are about to be redone), so the curve of a
resumed run has no duplicates and equals the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any


class MetricsWriter:
    def __init__(self, path: Path, resumed_step: int, enabled: bool) -> None:
        self._file: IO[str] | None = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in read_metrics(path) if line["step"] <= resumed_step]
        # Write-then-rename: a crash while truncating never loses the curve so far.
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
        tmp.replace(path)
        self._file = path.open("a", buffering=1)  # line-buffered: a killed run keeps every finished step

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a torn last line from a killed writer is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records

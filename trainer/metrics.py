"""``metrics.jsonl``: one JSON line per logged step, written by rank 0 only.

The file is the run's loss curve. On resume, lines past the resumed step are dropped first (they
came from steps whose checkpoint never committed and are about to be redone), so the curve of a
resumed run has no duplicates and equals the uninterrupted one.

A run with a ``mirror_url`` (``JobConfig.run_url``, an object store) also keeps the file there: rank 0
copies it up every few seconds and once more at the end, and on start continues the curve the store
holds. A Kubernetes pod's run directory dies with the pod, so a restarted gang must take the curve
from the store, and the orchestrator, on another machine, follows the store while the run trains.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NamedTuple

from trainer import storage

MIRROR_INTERVAL_S = 2.0  # a small file, uploaded only when it grew: cheap, and the progress stays live
log = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, path: Path, resumed_step: int, enabled: bool, mirror_url: str | None = None) -> None:
        self._file: IO[str] | None = None
        self._mirror: FileMirror | None = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        earlier = (
            read_metrics(mirror_url) if mirror_url and storage.exists(mirror_url) else read_metrics(path)
        )
        kept = [line for line in earlier if line["step"] <= resumed_step]
        # Write-then-rename: a crash while truncating never loses the curve so far.
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
        tmp.replace(path)
        self._file = path.open("a", buffering=1)  # line-buffered: a killed run keeps every finished step
        if mirror_url:
            self._mirror = FileMirror(path, mirror_url)

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
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None


class FileMirror:
    """Copies a local file to a store URL now, whenever it has changed (checked every ``interval_s``
    in a background thread), and once more on close.

    A failed upload is a warning, not an error: the next one carries the same lines, and telemetry
    must never stop training.
    """

    def __init__(self, path: Path, url: str, interval_s: float = MIRROR_INTERVAL_S) -> None:
        self.path, self.url, self.interval_s = path, url, interval_s
        self._sent: bytes | None = None
        self._stop = threading.Event()
        self.sync()
        self._thread = threading.Thread(target=self._follow, name="metrics-mirror", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync()

    def sync(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        if data == self._sent:
            return
        try:
            storage.write_atomic(self.url, data)
        except storage.StoreError as exc:
            log.warning("metrics not mirrored this time (next try in %.0f s): %s", self.interval_s, exc)
            return
        self._sent = data

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sync()


def mirror_of(path: Path, run_url: str | None) -> str | None:
    """Where the run file ``path`` is mirrored under the run's store URL (None: not mirrored)."""
    return storage.join(run_url, path.name) if run_url else None


class JsonLines(NamedTuple):
    """The records of a JSON-lines file, and how many of its lines could not be read as one."""

    records: list[dict[str, Any]]
    skipped: int

    def skipped_note(self, name: str) -> str:
        """'3 unreadable lines of metrics.jsonl skipped', or '' when none were."""
        if not self.skipped:
            return ""
        return f"{self.skipped} unreadable line{'s' if self.skipped > 1 else ''} of {name} skipped"


def read_json_lines(
    source: Path | str, readable: Callable[[Any], bool] = lambda r: isinstance(r, dict)
) -> JsonLines:
    """The lines of a local or store JSONL file that parse and are ``readable``; a damaged line (not
    UTF-8, not JSON, a torn last line from a killed writer, the wrong shape) is skipped and counted,
    never an error: a report over a damaged file still reports. No file yet: none."""
    try:
        data = Path(source).read_bytes() if isinstance(source, Path) else storage.read(source)
    except (FileNotFoundError, storage.StoreNotFound):
        return JsonLines([], 0)
    records, skipped = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # bytes: invalid UTF-8 is a ValueError too
        except (ValueError, RecursionError):
            record = None
        if record is not None and readable(record):
            records.append(record)
        else:
            skipped += 1
    return JsonLines(records, skipped)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_metrics_record(record: object) -> bool:
    """What every reader of a step's line relies on: an object with an integer ``step`` and a numeric
    ``loss``, whose other fields are numbers, flags or null, or a mapping of numbers (tokens by source)."""
    if not isinstance(record, dict) or type(record.get("step")) is not int or not _number(record.get("loss")):
        return False
    return all(
        value is None
        or isinstance(value, bool)
        or _number(value)
        or (isinstance(value, dict) and all(_number(v) for v in value.values()))
        for value in record.values()
    )


def load_metrics(source: Path | str) -> JsonLines:
    """A metrics file's step records, and the count of lines skipped as unreadable."""
    return read_json_lines(source, is_metrics_record)


def read_metrics(source: Path | str) -> list[dict[str, Any]]:
    """Every readable step record of a metrics file, a local path or a store URL (see ``load_metrics``)."""
    return load_metrics(source).records

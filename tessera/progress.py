"""Progress bars for people at a terminal, silence for logs and CI.

``interactive()`` is the one switch: bars only when stderr is a terminal and ``CI`` is unset, so a
worker's log, a test's captured output or a CI transcript never fills with carriage returns.
``StepProgress`` follows a run's ``metrics.jsonl`` from a background thread, so it shows training
steps whichever process (torchrun workers, a Prefect task) writes them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from trainer.metrics import read_metrics

POLL_S = 0.5


def interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI")


class StepProgress:
    """A rich bar over training steps (step n/N, loss, tokens/s) read from the run's ``metrics.jsonl``.

    ``metrics`` finds that file: the run directory may only be known once the flow has opened the run.
    A no-op when not :func:`interactive`. The bar appears with the first logged step, so it does not
    sit at 0% through data preparation; on resume it starts from the resumed step.
    """

    def __init__(self, metrics: Callable[[], Path | None], total_steps: int) -> None:
        self.metrics, self.total = metrics, total_steps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="step-progress", daemon=True)

    def __enter__(self) -> StepProgress:
        if interactive():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _follow(self) -> None:
        bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),  # stdout stays for results (run dir, checkpoint URL)
        )
        task = None
        while True:
            stopping = self._stop.wait(POLL_S)
            path = self.metrics()
            records = read_metrics(path) if path is not None else []
            if records and task is None:
                bar.start()
                task = bar.add_task("train", total=self.total, status="")
            if records and task is not None:
                last = records[-1]
                bar.update(
                    task,
                    completed=last["step"],
                    status=f"loss {last['loss']:.4f} · {last['tokens_per_s']:,.0f} tok/s",
                )
            if stopping:
                break
        if task is not None:
            bar.stop()

"""The step watchdog: turn a silent hang into a fast, classifiable node failure.

A rank stuck in a collective behind a dead or wedged peer waits for the process-group timeout
(minutes) or forever. The watchdog bounds each step instead: past its allowance it says which step
hung and ends the process with :data:`EXIT_HANG`, so torchrun restarts the group and the orchestrator
retries it as a node failure. ``os._exit`` because the main thread is blocked and cannot unwind.

A step's allowance is ``faults.step_timeout_s`` or :data:`SLOWEST_STEP_FACTOR` times the slowest step
of this attempt so far, whichever is longer: a machine that got busier slows every step and is not
hung, while a hang never ends, so the multiple still catches it. The attempt's first step, which also
warms up (allocations, compilation, the first collectives) and has nothing measured before it, is
allowed ``first_step_s`` (``faults.collective_timeout_s``, which bounds its collectives anyway) if longer.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType

from trainer.failures import EXIT_HANG

SLOWEST_STEP_FACTOR = 10.0


class StepWatchdog:
    def __init__(self, timeout_s: float, rank: int, first_step_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.first_step_s = first_step_s
        self.rank = rank
        self._step = 0
        self._deadline: float | None = None
        self._armed_at = 0.0
        self.slowest_s = 0.0  # the slowest step so far (armed to disarmed)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def __enter__(self) -> StepWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stopped.set()
        self._thread.join()

    def allowance_s(self) -> float:
        if not self.slowest_s:
            return max(self.timeout_s, self.first_step_s)
        return max(self.timeout_s, SLOWEST_STEP_FACTOR * self.slowest_s)

    def arm(self, step: int) -> None:
        with self._lock:
            self._step, self._armed_at = step, time.monotonic()
            self._deadline = self._armed_at + self.allowance_s()

    def disarm(self) -> None:
        with self._lock:
            if self._deadline is not None:
                self.slowest_s = max(self.slowest_s, time.monotonic() - self._armed_at)
            self._deadline = None

    def _watch(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._stopped.wait(poll_s):
            with self._lock:
                hung = self._deadline is not None and time.monotonic() > self._deadline
                step, allowed = self._step, self._deadline - self._armed_at if hung else 0.0
            if hung:
                print(
                    f"[rank {self.rank}] step {step} hung: no progress for {allowed:.3g}s (faults.step_timeout_s="
                    f"{self.timeout_s:g}s, or {SLOWEST_STEP_FACTOR:g}x the slowest step so far, "
                    f"{self.slowest_s:.3g}s, or for a first step {self.first_step_s:g}s); exiting with code {EXIT_HANG} (node failure) so the job "
                    "restarts from the last checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_HANG)

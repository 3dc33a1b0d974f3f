"""Fault-injection hooks for tests: real NaNs, hangs and crashes inside a real training run.

Read once from the environment at start-up; with none set (every production run) they do nothing.

* ``TESSERA_FAULT_NAN_AT_STEP=N`` — step N's loss becomes NaN on every rank (the NaN guard fires).
* ``TESSERA_FAULT_HANG_AT_STEP=N`` — rank 0 stops making progress at step N (the watchdog fires;
  the other ranks block in the next collective, as behind a real stuck chip).
* ``TESSERA_FAULT_CRASH_AT_STEP=N`` — the last rank SIGKILLs itself at step N, on the first attempt
  only (``TORCHELASTIC_RESTART_COUNT=0``), so torchrun's restart then resumes and finishes.
* ``TESSERA_FAULT_SLOW_RANK=R`` — rank R sleeps ``TESSERA_FAULT_SLOW_S`` seconds (default 0.5)
  before every step: a straggler, for the per-rank telemetry of :mod:`trainer.telemetry` to name.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import torch


def _step(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


@dataclass(frozen=True)
class FaultInjector:
    nan_at_step: int | None = None
    hang_at_step: int | None = None
    crash_at_step: int | None = None
    slow_rank: int | None = None
    slow_s: float = 0.5

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(
            nan_at_step=_step("TESSERA_FAULT_NAN_AT_STEP"),
            hang_at_step=_step("TESSERA_FAULT_HANG_AT_STEP"),
            crash_at_step=_step("TESSERA_FAULT_CRASH_AT_STEP"),
            slow_rank=_step("TESSERA_FAULT_SLOW_RANK"),
            slow_s=float(os.environ.get("TESSERA_FAULT_SLOW_S", "0.5")),
        )

    def before_step(self, step: int, rank: int, world_size: int) -> None:
        if step == self.hang_at_step and rank == 0:
            threading.Event().wait()  # blocks forever; only the watchdog ends this process
        if rank == self.slow_rank:
            time.sleep(self.slow_s)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == self.crash_at_step and rank == world_size - 1 and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step == self.nan_at_step else loss

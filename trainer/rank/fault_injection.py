"""Fault-injection hooks for tests: real NaNs, hangs and crashes inside a real training run.

Read once from the environment at start-up; with none set (every production run) they do nothing.
How the orchestrator then classifies the failures these cause is :mod:`trainer.failures`' business.
The trainer holds one :class:`FaultInjector` and hands it to whatever it hooks into (the step loop,
``CheckpointManager(faults=...)``).

* ``TESSERA_FAULT_NAN_AT_STEP=N`` — step N's loss becomes NaN on every rank (the NaN guard fires).
* ``TESSERA_FAULT_HANG_AT_STEP=N`` — rank 0 stops making progress at step N (the watchdog fires;
  the other ranks block in the next collective, as behind a real stuck chip).
* ``TESSERA_FAULT_CRASH_AT_STEP=N`` — the last rank SIGKILLs itself at step N, on the first attempt
  only (``TORCHELASTIC_RESTART_COUNT=0``), so torchrun's restart then resumes and finishes.
* ``TESSERA_FAULT_KILL_IN_SAVE_AT_STEP=N`` — the last rank SIGKILLs itself inside step N's checkpoint
  write, after writing its shard files and before it reports them (so before DCP's ``.metadata`` and
  tessera's manifest): the partial a death mid-upload leaves. First attempt only, as above; with an
  async save the kill lands in the background upload thread.
* ``TESSERA_FAULT_SLOW_RANK=R`` — rank R sleeps ``TESSERA_FAULT_SLOW_S`` seconds (default 0.5)
  before every step: a straggler, for the per-rank telemetry of :mod:`trainer.rank.telemetry` to name.
* ``TESSERA_FAULT_HOLD_AT_STEP=N`` with ``TESSERA_FAULT_HOLD_UNTIL=PATH`` — every rank waits before
  step N until PATH exists: a test orders its processes by an event (a peer is back) instead of
  racing them against a fixed pace that a busy machine breaks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

log = logging.getLogger(__name__)
HOLD_POLL_S = 0.05


def _die(what: str) -> NoReturn:
    log.warning("injected fault: %s", what)  # the fault tests time recovery from this line
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _step(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


@dataclass(frozen=True)
class FaultInjector:
    nan_at_step: int | None = None
    hang_at_step: int | None = None
    crash_at_step: int | None = None
    kill_in_save_at_step: int | None = None
    slow_rank: int | None = None
    slow_s: float = 0.5
    hold_at_step: int | None = None
    hold_until: str = ""

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(
            nan_at_step=_step("TESSERA_FAULT_NAN_AT_STEP"),
            hang_at_step=_step("TESSERA_FAULT_HANG_AT_STEP"),
            crash_at_step=_step("TESSERA_FAULT_CRASH_AT_STEP"),
            kill_in_save_at_step=_step("TESSERA_FAULT_KILL_IN_SAVE_AT_STEP"),
            slow_rank=_step("TESSERA_FAULT_SLOW_RANK"),
            slow_s=float(os.environ.get("TESSERA_FAULT_SLOW_S", "0.5")),
            hold_at_step=_step("TESSERA_FAULT_HOLD_AT_STEP"),
            hold_until=os.environ.get("TESSERA_FAULT_HOLD_UNTIL", ""),
        )

    def before_step(self, step: int, rank: int, world_size: int) -> None:
        if step == self.hang_at_step and rank == 0:
            threading.Event().wait()  # blocks forever; only the watchdog ends this process
        if rank == self.slow_rank:
            time.sleep(self.slow_s)
        if step == self.hold_at_step:
            while not os.path.exists(self.hold_until):
                time.sleep(HOLD_POLL_S)
        if step == self.crash_at_step and rank == world_size - 1 and _first_attempt():
            _die(f"SIGKILL rank {rank} before step {step}")

    def checkpoint_writer(
        self, writer: StorageWriter, step: int, rank: int, world_size: int
    ) -> StorageWriter:
        """``writer``, made to die after writing its files if this is the save to kill."""
        if step != self.kill_in_save_at_step or rank != world_size - 1 or not _first_attempt():
            return writer
        write_data = writer.write_data

        def write_then_die(plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            write_data(plan, planner).wait()
            _die(f"SIGKILL rank {rank} inside step {step}'s checkpoint write")

        writer.write_data = write_then_die  # type: ignore[method-assign]
        return writer

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step == self.nan_at_step else loss

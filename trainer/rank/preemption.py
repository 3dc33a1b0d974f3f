"""Preemption: SIGTERM becomes an emergency checkpoint of the step that was running, then a clean exit.

SIGTERM is how a rank hears that it is about to lose its machine: Kubernetes deleting the pod within
``terminationGracePeriodSeconds``, a spot/preemption notice, torchrun stopping its workers because
its own launcher was stopped. Each rank's handler only raises a flag; after every step the ranks
agree on it (one all-reduce of one number, so all of them stop after the same step), save that step
and exit with :data:`trainer.failures.EXIT_PREEMPTED`: retryable, not a user error, no step lost.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Raised after the emergency checkpoint of ``step`` is saved."""

    def __init__(self, step: int) -> None:
        super().__init__(
            f"preempted (SIGTERM) after step {step}, which is checkpointed; a rerun resumes there"
        )
        self.step = step


class PreemptionWatch:
    """SIGTERM sets a flag (in the main thread, where handlers run); :meth:`agreed` shares it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, frame: object) -> None:
        if not self.requested:
            log.warning("SIGTERM: finishing this step, then an emergency checkpoint")
        self.requested = True

    def agreed(self) -> bool:
        """Whether any rank was told to stop (a collective: every rank calls it after each step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

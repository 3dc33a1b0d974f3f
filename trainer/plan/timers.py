"""How calibration times work on a device: one small interface, two clocks.

A CUDA kernel returns to Python when it is queued, not when it has run, so the host's clock around a
call measures the launch. :class:`CudaEventTimer` records CUDA events on the stream before and after the
calls and reads the device's own elapsed time between them. Everywhere else (CPU; TPU and Trainium,
whose runtimes expose no event timer here) :class:`HostTimer` reads ``time.perf_counter`` around the
calls, draining the device's queue first and last (``torch.accelerator.synchronize``). Calibration's
functions take a timer, so the CPU tests run the very functions a GPU calibration runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch


class Timer(Protocol):
    def seconds(self, fn: Callable[[], object], calls: int) -> float:
        """Mean seconds per call of ``calls`` back-to-back calls of ``fn``, as the device ran them."""
        ...


class HostTimer:
    """``perf_counter`` around the calls, with the device's queue drained before and after."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def seconds(self, fn: Callable[[], object], calls: int) -> float:
        self._sync()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        self._sync()
        return (time.perf_counter() - began) / calls


class CudaEventTimer:
    """CUDA events around the calls on the current stream: the device's time, not the launches'."""

    def seconds(self, fn: Callable[[], object], calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls  # elapsed_time is in milliseconds


def device_timer(device: torch.device) -> Timer:
    return CudaEventTimer() if device.type == "cuda" else HostTimer(device)

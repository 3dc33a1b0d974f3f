"""The one interface behind which accelerator differences live.

The training loop asks its backend for a device, a process group and launch environment; it never
branches on the accelerator itself. Accelerator libraries are imported inside methods, so importing
this package needs nothing beyond torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from abc import ABC, abstractmethod
from datetime import timedelta
from types import ModuleType

import torch
import torch.distributed as dist

from trainer.backends.chips import Chip, get_chip


class BackendUnavailable(RuntimeError):
    """The accelerator's runtime is not installed or sees no device; the message says how to fix it."""


class Backend(ABC):
    name: str
    device_type: str
    dist_backend: str
    install_hint: str = ""

    @abstractmethod
    def is_available(self) -> bool:
        """Whether the runtime imports and sees at least one device."""

    def require(self) -> None:
        if not self.is_available():
            raise BackendUnavailable(f"backend {self.name!r} is not available here: {self.install_hint}")

    def device(self, local_rank: int) -> torch.device:
        return torch.device(self.device_type, local_rank)

    def init_process_group(self, timeout_s: float) -> None:
        """Join the torchrun rendezvous; ``timeout_s`` bounds every collective so a lost peer fails fast.

        torchrun keeps one store across ``--max-restarts`` restarts, so a restarted rank could read a
        dead peer's address from the previous attempt (gloo: "connectFullMesh failed ... Connection
        refused"); keys are therefore prefixed with the attempt number. Not in an elastic job: there
        rank 0 hosts a fresh store every round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, see
        trainer.runtime.launch), and each agent counts its own restarts (a returning node starts at 0).
        """
        if dist.is_initialized():
            return
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "False":
            store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(
            backend=self.dist_backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        """Environment variables the launcher sets on every worker of this backend."""
        return {}

    def supports_bf16(self) -> bool:
        return True

    def chip(self, name: str) -> Chip:
        chip = get_chip(name)
        if chip.accelerator != self.name:
            raise ValueError(f"chip {name!r} is a {chip.accelerator} chip, not {self.name}")
        return chip


class PluginBackend(Backend):
    """An accelerator whose runtime is an optional extra that plugs a device into torch.

    Importing ``runtime_module`` registers the device type, its ``torch.<device_type>`` module and its
    process-group backend (TorchTPU's ``tpu``, TorchNeuron's ``neuron``); after that the accelerator
    is driven like CUDA. The import happens on first use, so tests never need the extra.
    """

    runtime_module: str

    def runtime(self) -> ModuleType:
        if importlib.util.find_spec(self.runtime_module) is None:
            raise BackendUnavailable(f"{self.runtime_module} is not installed: {self.install_hint}")
        return importlib.import_module(self.runtime_module)

    def is_available(self) -> bool:
        try:
            self.runtime()
        except BackendUnavailable:
            return False
        return getattr(torch, self.device_type).is_available()

    def device(self, local_rank: int) -> torch.device:
        self.runtime()
        getattr(torch, self.device_type).set_device(local_rank)
        return torch.device(self.device_type, local_rank)

    def init_process_group(self, timeout_s: float) -> None:
        self.runtime()
        super().init_process_group(timeout_s)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))

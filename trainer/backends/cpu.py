"""CPU backend: gloo over loopback. What tests and local runs use."""

from __future__ import annotations

import torch

from trainer.backends.base import Backend


class CPUBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        # Several ranks share a few cores: one intra-op thread each avoids oversubscription thrash.
        return {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}

"""NVIDIA GPU backend: CUDA devices, NCCL collectives."""

from __future__ import annotations

import torch

from trainer.backends.base import Backend


class GPUBackend(Backend):
    name = "gpu"
    device_type = "cuda"
    dist_backend = "nccl"
    install_hint = "install the CUDA build of torch==2.13.0 (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128) and run on a host with NVIDIA GPUs"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self, local_rank: int) -> torch.device:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        return {
            # Fail a hung collective with an exception instead of waiting forever (torch ≥ 2.2 name).
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            # Needed for overlapping FSDP2 all-gathers with compute without allocator thrash.
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            # EFA via aws-ofi-nccl on AWS; ignored where the plugin is absent.
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "NCCL_DEBUG": "WARN",
        }

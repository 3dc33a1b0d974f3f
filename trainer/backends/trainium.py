"""AWS Trainium backend: the Neuron SDK's native TorchNeuron device (``neuron``), ``import torch_neuronx``.

TorchNeuron registers a ``neuron`` device type and a ``neuron`` process-group backend, so FSDP2,
DTensor and ``torch.distributed.pipelining`` run as on GPU and ``torch.compile(backend="neuron")``
compiles blocks. The older XLA-based torch-neuronx path is end-of-support and deliberately not used.
"""

from __future__ import annotations

import torch

from trainer.backends.base import PluginBackend

NEURON_CORES_PER_CHIP = 8  # Trainium2 (AWS Neuron docs, trainium2 arch)


class TrainiumBackend(PluginBackend):
    name = "trainium"
    device_type = "neuron"
    dist_backend = "neuron"
    runtime_module = "torch_neuronx"
    install_hint = (
        "install TorchNeuron (torch_neuronx) from the Neuron SDK's package repository, or use an AWS "
        "Neuron DLC image, on a trn2/trn3 instance"
    )

    def device(self, local_rank: int) -> torch.device:
        # NEURON_RT_NUM_CORES (below) gives each process the cores of one chip, which it sees as device 0.
        return super().device(0)

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        # torchrun starts one process per chip, each with this environment: the count is per process.
        # The runtime hands each its own free cores; chips_per_node × 8 would make every process claim
        # the whole host and all but the first fail to start.
        return {
            "NEURON_RT_NUM_CORES": str(NEURON_CORES_PER_CHIP),
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "NEURON_CC_FLAGS": "--model-type=transformer",
        }

"""AWS Trainium backend: the Neuron SDK's native TorchNeuron device (``neuron``), ``import torch_neuronx``.

TorchNeuron registers a ``neuron`` device type and a ``neuron`` process-group backend, so FSDP2,
DTensor and ``torch.distributed.pipelining`` run as on GPU and ``torch.compile(backend="neuron")``
compiles blocks. The older XLA-based torch-neuronx path is end-of-support and deliberately not used.
"""

from __future__ import annotations

from trainer.backends.base import PluginBackend


class TrainiumBackend(PluginBackend):
    name = "trainium"
    device_type = "neuron"
    dist_backend = "neuron"
    runtime_module = "torch_neuronx"
    install_hint = (
        "install TorchNeuron (torch_neuronx) from the Neuron SDK's package repository, or use an AWS "
        "Neuron DLC image, on a trn2/trn3 instance"
    )

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        return {
            "NEURON_RT_NUM_CORES": str(chips_per_node * 8),  # Trainium2: 8 NeuronCores per chip
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "NEURON_CC_FLAGS": "--model-type=transformer",
        }

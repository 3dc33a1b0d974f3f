"""AWS Trainium backend: the Neuron SDK's native TorchNeuron device (``neuron``).

TorchNeuron registers a ``neuron`` device type and a ``neuron`` process-group backend, so FSDP2,
DTensor and ``torch.distributed.pipelining`` run as on GPU and ``torch.compile(backend="neuron")``
compiles blocks. The older torch-neuronx XLA path is end-of-support and deliberately not used.
"""

from __future__ import annotations

import importlib.util

import torch

from trainer.backends.base import Backend, BackendUnavailable


class TrainiumBackend(Backend):
    name = "trainium"
    device_type = "neuron"
    dist_backend = "neuron"
    install_hint = "use an AWS Neuron DLC image (Neuron SDK with TorchNeuron) on a trn1/trn2 instance"

    def _module(self):
        if importlib.util.find_spec("torch_neuron") is None:
            raise BackendUnavailable(f"TorchNeuron (torch_neuron) is not installed: {self.install_hint}")
        import torch_neuron  # lazy: registers the 'neuron' device and process-group backend

        return torch_neuron

    def is_available(self) -> bool:
        try:
            self._module()
        except BackendUnavailable:
            return False
        return hasattr(torch, "neuron") and torch.neuron.is_available()

    def device(self, local_rank: int) -> torch.device:
        self._module()
        torch.neuron.set_device(local_rank)
        return torch.device("neuron", local_rank)

    def init_process_group(self, timeout_s: float) -> None:
        self._module()
        super().init_process_group(timeout_s)

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        return {
            "NEURON_RT_NUM_CORES": str(chips_per_node * 8),  # Trainium2: 8 NeuronCores per chip
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "NEURON_CC_FLAGS": "--model-type=transformer",
        }

"""Google TPU backend: TorchTPU (``torch_tpu``), Google's current PyTorch-on-TPU runtime.

``import torch_tpu`` registers the ``tpu`` device, ``torch.tpu`` and the ``tpu_dist`` process-group
backend, so FSDP2, DTensor and pipelining run as on GPU. torch_xla stopped at 2.9 and is not used.
"""

from __future__ import annotations

from trainer.backends.base import PluginBackend


class TPUBackend(PluginBackend):
    name = "tpu"
    device_type = "tpu"
    dist_backend = "tpu_dist"
    runtime_module = "torch_tpu"
    install_hint = (
        "pip install 'tessera[tpu]' (TorchTPU: torch_tpu 0.2, built for torch 2.11-2.15) on a Cloud TPU "
        "VM or GKE TPU node"
    )

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        # TorchTPU derives each process's TPU addresses itself, from the TPU_WORKER_HOSTNAMES and
        # JOB_COMPLETION_INDEX that GKE sets on TPU slice pods; there is nothing to add here.
        return {}

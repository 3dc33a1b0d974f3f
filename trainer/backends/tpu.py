"""Google TPU backend: torch_xla over PJRT, XLA collectives."""

from __future__ import annotations

import importlib.util

import torch

from trainer.backends.base import Backend, BackendUnavailable


class TPUBackend(Backend):
    name = "tpu"
    device_type = "xla"
    dist_backend = "xla"
    install_hint = "pip install 'tessera[tpu]' (torch_xla[tpu]) on a Cloud TPU VM or GKE TPU node"

    def is_available(self) -> bool:
        if importlib.util.find_spec("torch_xla") is None:
            return False
        import torch_xla.runtime as xr  # lazy: an optional extra

        return xr.device_type() == "TPU"

    def device(self, local_rank: int) -> torch.device:
        try:
            import torch_xla.core.xla_model as xm
        except ImportError as exc:
            raise BackendUnavailable(f"torch_xla is not installed: {self.install_hint}") from exc
        return xm.xla_device()

    def init_process_group(self, timeout_s: float) -> None:
        # Registers the 'xla' process-group backend; PJRT supplies rank/world from the TPU runtime.
        try:
            import torch_xla.distributed.xla_backend  # noqa: F401
        except ImportError as exc:
            raise BackendUnavailable(f"torch_xla is not installed: {self.install_hint}") from exc
        super().init_process_group(timeout_s)

    def launch_env(self, chips_per_node: int) -> dict[str, str]:
        return {"PJRT_DEVICE": "TPU", "XLA_USE_BF16": "0"}

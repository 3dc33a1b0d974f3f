"""Accelerator backends behind one interface: ``get_backend(accelerator)``.

Only the chip catalog is imported eagerly, so spec validation and planning never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.backends.chips import CHIPS, Chip, chips_for, get_chip

if TYPE_CHECKING:
    from trainer.backends.base import Backend

__all__ = ["CHIPS", "Chip", "chips_for", "get_backend", "get_chip"]


def get_backend(accelerator: str) -> Backend:
    """The backend for an accelerator family; its runtime library is imported only when used."""
    from trainer.backends.cpu import CPUBackend
    from trainer.backends.gpu import GPUBackend
    from trainer.backends.tpu import TPUBackend
    from trainer.backends.trainium import TrainiumBackend

    backends: dict[str, type[Backend]] = {
        "cpu": CPUBackend,
        "gpu": GPUBackend,
        "tpu": TPUBackend,
        "trainium": TrainiumBackend,
    }
    try:
        return backends[accelerator]()
    except KeyError:
        raise ValueError(
            f"unknown accelerator {accelerator!r}; choose one of {', '.join(backends)}"
        ) from None

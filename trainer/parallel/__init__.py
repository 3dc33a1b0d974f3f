"""Parallelisms as plain functions of a model and a mesh, and the ParallelModel the training loop drives.

The training loop needs three calls: ``build_parallel_model(job, device)`` (mesh, init, TP / AC /
compile / FSDP / PP, each by the model family's own plan: ``trainer/models/<family>/``), ``model.forward_backward(inputs, targets, n_microbatches)`` and
``model.clip_grad_norm_(max_norm)``; optimizers and checkpoints take ``model.parts``.
"""

from trainer.parallel.activation import apply_ac
from trainer.parallel.compile import apply_compile
from trainer.parallel.context import apply_cp
from trainer.parallel.expert import apply_ep
from trainer.parallel.float8 import apply_float8
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.mesh import MESH_DIMS, build_mesh, dp_mesh
from trainer.parallel.parallel_model import ParallelModel, build_parallel_model, token_loss

__all__ = [
    "MESH_DIMS",
    "ParallelModel",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_ep",
    "apply_float8",
    "apply_fsdp",
    "build_mesh",
    "build_parallel_model",
    "dp_mesh",
    "token_loss",
]

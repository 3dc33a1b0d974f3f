"""fp8 matmuls through ``torchao.float8``: the blocks' linear layers compute in fp8 with dynamic scales.

tensorwise: one scale per tensor, the fastest recipe; rowwise: one scale per row (and per column of
the gradients), slower but robust to outlier rows, torchtitan's choice for large runs. Weights stay in
the FSDP parameter dtype and are cast to fp8 inside each matmul, so optimizer state, checkpoints and
parameter names are unchanged (``Float8Linear`` subclasses ``nn.Linear``).

Applied before activation checkpointing, compile and FSDP, as torchtitan does. FSDP's fp8 all-gather
(``enable_fsdp_float8_all_gather``, which gathers weights already cast to fp8 and halves the gather
bytes) stays off: over gloo it fails ("Invalid scalar type"), so nothing here could test it.

torchao is imported only when fp8 is on: its import is slow and, on CPU, noisy about CUDA kernels.
"""

from __future__ import annotations

from torch import nn

from trainer.config import Float8Recipe

# torch._scaled_mm, fp8's matmul, needs both dimensions of the weight divisible by 16.
FP8_DIM_MULTIPLE = 16
# The output head stays in the compute dtype: its logits feed the loss, where fp8 error shows first.
HIGH_PRECISION_MODULES = ("output",)


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Convert a linear layer unless it is the head or its shape does not suit the fp8 matmul."""
    if not isinstance(module, nn.Linear) or fqn in HIGH_PRECISION_MODULES:
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def apply_float8(model: nn.Module, recipe: Float8Recipe) -> nn.Module:
    """Swap model's eligible ``nn.Linear`` layers for torchao's ``Float8Linear`` in place."""
    if recipe == "none":
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=fp8_eligible)

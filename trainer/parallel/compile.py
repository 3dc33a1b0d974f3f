"""torch.compile per transformer block.

Per block rather than whole-model: blocks are identical, so one graph is compiled and reused, and
FSDP's per-block hooks stay outside the graphs. ``Module.compile`` compiles in place, keeping FQNs.
"""

from __future__ import annotations

from trainer.model import Transformer


def apply_compile(model: Transformer, backend: str = "inductor") -> Transformer:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
    return model

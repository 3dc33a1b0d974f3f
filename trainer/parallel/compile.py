"""torch.compile per transformer block, its persistent cache, and what compiling cost.

Per block rather than whole-model: blocks are identical, so one graph is compiled and reused, and
FSDP's per-block hooks stay outside the graphs. ``Module.compile`` compiles in place, keeping FQNs.

Compiling happens lazily, in the first step (the forward graph) and its backward (the backward
graph). Inductor's caches (FX graphs, AOTAutograd, Triton kernels) live under
``TORCHINDUCTOR_CACHE_DIR``; left unset it is ``/tmp/torchinductor_$USER``, which a new pod or host
does not have, so a retried or resumed run would compile again. The trainer points it at the run
directory unless the environment names a shared cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# torch's own timers (torch._dynamo.utils, private but stable across releases): Dynamo's frame
# compile including Inductor's forward graph, and the backward graph compiled at the first backward.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def apply_compile(model: nn.Module, backend: str = "inductor") -> nn.Module:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
    return model


def use_compile_cache(default: Path) -> Path:
    """Inductor's cache directory: ``$TORCHINDUCTOR_CACHE_DIR`` if the user set it (a shared cache), else
    ``default`` (set for this process, before anything compiles).

    Importing ``torch._dynamo`` (FSDP, DTensor and compile all do) writes torch's own default,
    ``/tmp/torchinductor_<user>``, into the variable, so that value counts as unset: else every run
    would share the machine's temporary cache and a resumed run on a fresh node would find nothing."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(CACHE_ENV)
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_ENV] = str(default)
    return Path(os.environ[CACHE_ENV])


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (0 until something compiles)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(timer, ())) for timer in COMPILE_TIMERS)

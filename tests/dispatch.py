"""What torch ran: every aten op and its outputs, for tests that check what a computation allocates."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RecordOps(TorchDispatchMode):
    """Records (op name, output) for every output tensor of every op run inside the ``with``."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.outputs.append((str(func), tensor))
        return out

    def largest(self, dtype: torch.dtype | None = None) -> int:
        """The most elements of any output (of ``dtype`` if given)."""
        return max((t.numel() for _, t in self.outputs if dtype in (None, t.dtype)), default=0)

    def ran(self, name: str) -> bool:
        return any(name in op for op, _ in self.outputs)

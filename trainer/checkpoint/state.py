"""Stateful wrappers that DCP saves and loads in place, whatever the parallel layout.

``get_state_dict``/``set_state_dict`` key model and optimizer state by parameter FQN (the model keeps
FQNs identical on every layout) and hand DCP sharded DTensors, so a checkpoint saved with one world
size or layout reshards on load into another.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

# The key the training state uses for ModelOptimizerState; evaluation reads "<APP_KEY>.model.*" only.
APP_KEY = "app"
# Flattened optimizer keys ("state.<fqn>.exp_avg") let several (part, optimizer) pairs, e.g. pipeline
# stages on one rank, share one dict and each pick out its own parameters on load.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelOptimizerState(Stateful):
    """Model parts and their optimizers (one optimizer per part) as one state dict."""

    def __init__(self, parts: list[nn.Module], optimizers: list[Optimizer]) -> None:
        if len(parts) != len(optimizers):
            raise ValueError(
                f"ModelOptimizerState needs one optimizer per model part, got {len(parts)} "
                f"parts and {len(optimizers)} optimizers"
            )
        self.parts = parts
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for part, optimizer in zip(self.parts, self.optimizers, strict=True):
            model.update(get_model_state_dict(part, options=_OPTIONS))
            optim.update(get_optimizer_state_dict(part, optimizer, options=_OPTIONS))
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False: each part holds only its own stage's parameters of the shared dict.
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, optimizer in zip(self.parts, self.optimizers, strict=True):
            set_model_state_dict(part, state_dict["model"], options=options)
            set_optimizer_state_dict(part, optimizer, state_dict["optim"], options=options)

    def weights(self) -> ModelWeights:
        """The model parts alone: what a weights-only checkpoint (an import) restores into."""
        return ModelWeights(self.parts)


class ModelWeights(Stateful):
    """Model parts' weights under ModelOptimizerState's "model" key, without their optimizers."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        for part in self.parts:
            model.update(get_model_state_dict(part, options=_OPTIONS))
        return {"model": model}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(strict=False)  # each part takes its own stage's parameters
        for part in self.parts:
            set_model_state_dict(part, state_dict["model"], options=options)


class RNGState(Stateful):
    """This rank's torch (CPU and current accelerator) and Python RNG states.

    Keyed by rank, so it only restores into the world size it was saved with; the manager skips it
    (and says so) when the world size changes.
    """

    def __init__(self, rank: int | None = None) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict[self.key]
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])

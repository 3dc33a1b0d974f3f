"""Shared by the checkpoint torchrun workers and tests: a tiny Transformer, FSDP2-sharded over every
rank, trained a few real steps so the optimizer, scheduler and loader all carry state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from trainer.checkpoint import ModelOptimizerState, RNGState
from trainer.config import JobConfig
from trainer.data.loader import StepLoader, build_loader
from trainer.models.llama.model import Transformer

JOB = JobConfig.model_validate(
    {
        "model": dict(
            preset="custom",
            n_layers=2,
            dim=32,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=64,
            vocab_size=128,
            rope_theta=1e4,
        ),
        "train": dict(seq_len=8, global_batch_size=4, micro_batch_size=1),
    }
)
TOKENS_PER_STEP = JOB.train.global_batch_size * JOB.train.seq_len


class Trainee:
    """Model, optimizer, LR schedule and data loader of one rank, in ``world`` FSDP2 shards."""

    def __init__(self, world: int, rank: int) -> None:
        self.rank = rank
        self.model = Transformer(JOB.model, JOB.train.seq_len)
        self.model.init_weights(JOB.seed)
        if world > 1:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            for block in self.model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = LambdaLR(self.optimizer, lambda step: 1 / (1 + step))
        self.loader: StepLoader = build_loader(JOB, rank, world)

    def state(self) -> dict[str, Any]:
        return {
            "app": ModelOptimizerState([self.model], [self.optimizer]),
            "scheduler": self.scheduler,
            "loader": self.loader,
            "rng": RNGState(self.rank),
        }

    def step(self) -> None:
        inputs, targets = next(self.loader)
        F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def full_state(self) -> dict[str, Any]:
        """Unsharded model + optimizer state (values on rank 0; collective when distributed) and the
        scheduler and loader states."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
        tensors: dict[str, Tensor | float] = {
            **{f"model.{k}": v for k, v in get_model_state_dict(self.model, options=options).items()},
            **{
                f"optim.{k}": v
                for k, v in get_optimizer_state_dict(self.model, self.optimizer, options=options).items()
            },
        }
        return {
            "tensors": tensors,
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
        }


def init_distributed() -> tuple[int, int]:
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    return dist.get_rank(), dist.get_world_size()

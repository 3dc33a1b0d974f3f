"""A second model family, registered from outside ``trainer/``, trained under FSDP on 2 gloo ranks.

The family is a stack of residual MLP blocks over token embeddings (no attention: each position
predicts its next token from itself alone, enough to learn counting sequences). It is registered
here, in the worker, with its own preset, parameter count and parallelize plan (FSDP only), and it
trains through the trainer's own ``build_parallel_model``: adding a family touches no core file.
Rank 0 also trains the unparallelized model on the whole batch, the reference the run must match.
Run by tests/test_model_registry.py: ``torchrun --nproc-per-node 2 -m tests.dist.toy_family OUT.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.config import JobConfig, ModelConfig, ParallelConfig
from trainer.models import ModelFamily, ParamCounts, family_of, register
from trainer.parallel import build_parallel_model
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.mesh import check_mesh, dp_mesh
from trainer.plan.params import count_params

WORLD, STEPS, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, LR = 2, 6, 16, 8, 2, 1e-2
# The attention fields are unused by this family but fill ModelConfig's shape, as every preset does.
TOY_PRESET = dict(n_layers=3, dim=32, n_heads=1, n_kv_heads=1, ffn_dim=64, vocab_size=64, rope_theta=1e4)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPModel(nn.Module):
    """Token ids -> logits, or the mean token loss given targets (the contract ModelFamily.build states)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MLPBlock(cfg.dim, cfg.ffn_dim) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        logits = self.output(self.norm(h))
        return logits if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def count_mlp_params(cfg: ModelConfig) -> ParamCounts:
    vocab, block = cfg.vocab_size * cfg.dim, 2 * cfg.dim * cfg.ffn_dim
    return ParamCounts(
        embedding=vocab,
        per_layer=block + cfg.dim,
        per_layer_matmul=block,
        n_layers=cfg.n_layers,
        final_norm=cfg.dim,
        output=vocab,
    )


def parallelize_mlp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> nn.Module:
    """FSDP over the data-parallel ranks, one unit per block; nothing else applies to this family."""
    check_mesh(mesh)
    if max(cfg.tp, cfg.cp, cfg.ep, cfg.pp) > 1:
        raise ValueError("the mlp family shards over data parallelism only; set parallel.tp/cp/ep/pp to 1")
    return apply_fsdp(model, dp_mesh(mesh), cfg.mixed_precision, cfg.reshard_after_forward)


def check_mlp(cfg: ModelConfig) -> None:
    if cfg.moe is not None:
        raise ValueError("model.moe: the mlp family has no experts; remove model.moe")


MLP = register(
    ModelFamily(
        name="mlp",
        presets={"toy-mlp": TOY_PRESET},
        check=check_mlp,
        build=lambda cfg, max_seq_len: MLPModel(cfg),
        count_params=count_mlp_params,
        parallelize=parallelize_mlp,
    )
)


def job() -> JobConfig:
    return JobConfig.model_validate(
        {
            "seed": 3,
            "model": {"preset": "toy-mlp"},
            "parallel": {"dp_shard": WORLD},
            "train": {
                "steps": STEPS,
                "seq_len": SEQ_LEN,
                "global_batch_size": GLOBAL_BATCH,
                "micro_batch_size": MICRO_BATCH,
            },
            "hardware": {"chips_per_node": WORLD},
        }
    )


def global_batch(step: int, vocab: int) -> tuple[Tensor, Tensor]:
    """Counting sequences from random starts: learnable, so the loss falls."""
    starts = torch.randint(vocab, (GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(100 + step))
    tokens = (starts + torch.arange(SEQ_LEN + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train_reference(job: JobConfig) -> list[float]:
    model = family_of(job.model).build(job.model, SEQ_LEN)
    model.init_weights(job.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(*global_batch(step, job.model.vocab_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_fsdp(job: JobConfig) -> dict[str, Any]:
    pm = build_parallel_model(job, torch.device("cpu"))
    (part,) = pm.parts
    optimizer = torch.optim.AdamW(part.parameters(), lr=LR)
    rows = GLOBAL_BATCH // pm.dp_size
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step, job.model.vocab_size)
        local = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        losses.append(pm.forward_backward(inputs[local], targets[local], rows // MICRO_BATCH).item())
        optimizer.step()
        optimizer.zero_grad()
    local_params = sum(p.to_local().numel() for p in part.parameters())
    # The planner's count (through the registry) against what this rank's FSDP shards hold.
    return {"loss": losses, "module": type(part).__name__, "stored": local_params / count_params(job.model).total}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == WORLD, f"run with --nproc-per-node {WORLD}"
    result = {"fsdp": train_fsdp(job())}
    if dist.get_rank() == 0:
        result["reference"] = train_reference(job())
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

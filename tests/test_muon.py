"""Muon (``optimizer.name: muon``): its math against torch's own, the spec's refusals, the planner's
pricing, and a 2-process FSDP run whose loss falls and resumes bitwise across a kill -9."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from deployments.spec import TrainingSpec
from tests.test_train import curve, lost_a_rank_to_sigkill, spec_with, tessera_train
from trainer.backends.chips import get_chip
from trainer.config import ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
from trainer.plan.compute import MUON_NS_STEPS, newton_schulz_gemms, optimizer_seconds
from trainer.plan.hbm import estimate_memory
from trainer.plan.layout import Geometry
from trainer.plan.profile import catalog_profile
from trainer.rank.muon import MOMENTUM, NS_STEPS, MuonWithAdamW
from trainer.rank.optim import build_optimizer

CFG = OptimizerConfig(name="muon", lr=2e-2, weight_decay=0.1)


class Toy(nn.Module):
    """The shape of a family's model: an embedding, blocks under ``layers``, a final norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(16, 24, bias=False), nn.LayerNorm(24))})
        self.layers["0"].append(nn.Linear(24, 16, bias=False))
        self.norm = nn.RMSNorm(16)
        self.output = nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.layers["0"](self.tok_embeddings(tokens))))


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (4, 8), generator=gen)
        model(tokens).logsumexp(-1).mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_muon_is_torchs_muon_on_hidden_matrices_and_adamw_elsewhere() -> None:
    torch.manual_seed(0)
    ours = Toy()
    ref = copy.deepcopy(ours)
    optimizer = build_optimizer(ours, CFG)
    assert isinstance(optimizer, MuonWithAdamW)
    muon = [p for n, p in ref.named_parameters() if n.startswith("layers.") and p.ndim == 2]
    rest = [p for n, p in ref.named_parameters() if not (n.startswith("layers.") and p.ndim == 2)]
    assert len(muon) == 2 and len(rest) == 5  # embedding, output and every norm gain/bias stay on AdamW
    torch_muon = torch.optim.Muon(
        muon,
        lr=CFG.lr,
        weight_decay=CFG.weight_decay,
        momentum=MOMENTUM,
        ns_steps=NS_STEPS,
        adjust_lr_fn="match_rms_adamw",
    )
    torch_adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2]},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=CFG.lr,
        betas=(CFG.beta1, CFG.beta2),
        eps=CFG.eps,
        weight_decay=CFG.weight_decay,
    )
    train(ours, [optimizer])
    train(ref, [torch_muon, torch_adamw])
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name
    state = optimizer.state_dict()["state"]
    assert {frozenset(s) for s in state.values()} == {
        frozenset({"step", "momentum_buffer"}),
        frozenset({"step", "exp_avg", "exp_avg_sq"}),
    }
    build_optimizer(Toy(), CFG).load_state_dict(optimizer.state_dict())  # what a resume does


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"parallel": {"tp": 2}, "cluster": {"chips_per_node": 2}}, "parallel.tp=1"),
        ({"model": {"preset": "tiny-moe"}}, "model.moe"),
    ],
)
def test_spec_refuses_layouts_muon_does_not_take(change: dict, field: str) -> None:
    spec = {"name": "m", "model": {"preset": "tiny"}, "optimizer": {"name": "muon"}, **change}
    with pytest.raises(ValidationError, match=field):
        TrainingSpec.model_validate(spec)


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.cold  # the killed rank is torchrun's own child; forked, a peer's echo is logged first more often
def test_fsdp_muon_run_learns_and_resumes_bitwise_after_kill_9(tmp_path: Path) -> None:
    """dp_shard=2, so every matrix is gathered for Newton-Schulz and its momentum is a DCP-saved shard."""
    spec = spec_with(optimizer={"name": "muon"}, checkpoint={"mode": "sync"}, faults={"max_restarts": 1})
    returncode, output = tessera_train(spec, tmp_path / "whole", {})
    assert returncode == 0, output[-4000:]
    returncode, output = tessera_train(spec, tmp_path / "killed", {"TESSERA_FAULT_CRASH_AT_STEP": "6"})
    assert returncode == 0, output[-4000:]
    assert lost_a_rank_to_sigkill(output) and "resumed from step 4" in output
    reference = curve(tmp_path / "whole")
    assert curve(tmp_path / "killed") == reference  # bitwise, momentum buffers and AdamW moments restored
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.1


def test_planner_prices_muon_state_transient_and_newton_schulz() -> None:
    """Llama 3 8B on 8 H100s: one momentum instead of two moments for the blocks' matrices, the gathered
    14336×4096 matrix's transient, and 5 × (4m²n + 2m³) FLOPs per matrix that FSDP does not divide."""
    model, parallel = ModelConfig(preset="llama3-8b"), ParallelConfig(dp_shard=8)
    train = TrainConfig(seq_len=8192, global_batch_size=8, micro_batch_size=1)
    adamw, muon = (Geometry(model, parallel, train, "gpu", name) for name in ("adamw", "muon"))
    matrices = sum(r * c for r, c in muon.muon_matrices)
    assert matrices == model.n_layers * adamw.counts.per_layer_matmul
    saved = estimate_memory(adamw).optimizer - estimate_memory(muon).optimizer
    assert saved == pytest.approx(4 * matrices / 8)
    assert estimate_memory(muon).optimizer_temp == pytest.approx(
        2 * (2 * 4096 * 14336 + 3 * 4096**2) + 4 * 4096 * 14336 / 8
    )
    flops = sum(2 * m * n * k for m, n, k in newton_schulz_gemms(muon))
    d, f, kv = 4096, 14336, 1024
    per_layer = (
        2 * (4 * d * d * d + 2 * d**3) + 2 * (4 * kv * kv * d + 2 * kv**3) + 3 * (4 * d * d * f + 2 * d**3)
    )
    assert flops == pytest.approx(MUON_NS_STEPS * 32 * per_layer)
    assert MUON_NS_STEPS == NS_STEPS and not newton_schulz_gemms(adamw)
    hw = catalog_profile(get_chip("h100-sxm"))
    assert optimizer_seconds(muon, hw) > optimizer_seconds(adamw, hw)

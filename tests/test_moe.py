"""Mixture of experts: routing against a per-token reference, the balancing loss, spec validation, and the
planner's counts (Mixtral 8x7B as published), active-parameter FLOPs and all-to-all pricing.

Distributed parity (FSDP, EP×FSDP, EP×HSDP, EP×TP) and checkpoint resharding run in
tests/test_parallel.py's single torchrun launch; here, an ep=2 run killed with kill -9 resumes exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.utils.checkpoint import checkpoint

from tests.pipeline_specs import MICRO_MODEL
from tests.test_train import curve, job_of, lost_a_rank_to_sigkill, spec_with, tessera_train
from trainer.checkpoint.hf import resolve_step
from trainer.config import JobConfig, ModelConfig, MoEConfig
from trainer.evaluate import load_model
from trainer.models import param_count
from trainer.models.llama.model import FeedForward, Transformer
from trainer.models.moe import MoE, auxiliary_loss_scale
from trainer.parallel import token_loss
from trainer.plan import make_plan
from trainer.plan.experts import all_to_all_bytes
from trainer.plan.flops import model_flops_per_token
from trainer.plan.layout import Geometry
from trainer.plan.params import count_params
from trainer.rank.step_hooks import after_optimizer_step

SMALL = dict(
    preset="custom", n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, rope_theta=1e4
)


def moe_layer(shared: bool, seed: int = 0, **balance: str | float) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(n_experts=4, top_k=2, shared_experts=int(shared), aux_loss_coef=0.1, **balance)
    layer = MoE(16, 24, cfg, FeedForward(16, 24) if shared else None)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return layer


# A routing bias large enough to decide selection: expert 3 always chosen, expert 0 never.
BIAS = torch.tensor([-1.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_output_is_each_tokens_top_k_experts_mixed_by_renormalized_router_weights(
    shared: bool, biased: bool
) -> None:
    """With balance 'bias', the bias picks the experts but the weights are the unbiased probabilities."""
    layer = moe_layer(shared, **({"balance": "bias"} if biased else {}))
    if biased:
        layer.router.expert_bias.copy_(BIAS)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    experts = layer.experts
    expected = []
    for token in x.reshape(-1, 16):
        probs = layer.router.gate(token).softmax(-1)
        chosen = (probs + (BIAS if biased else 0)).topk(2).indices
        top = probs[chosen]
        assert not biased or (3 in chosen and 0 not in chosen)
        mixed = sum(
            w / top.sum() * ((F.silu(token @ experts.w1[e]) * (token @ experts.w3[e])) @ experts.w2[e])
            for w, e in zip(top, chosen.tolist(), strict=True)
        )
        expected.append(mixed + (layer.shared(token) if shared else 0))
    torch.testing.assert_close(out.reshape(-1, 16), torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_balancing_loss_reaches_the_router_in_backward_scaled_like_the_micro_batch() -> None:
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    grads = []
    for scale in (1.0, 0.5):
        layer = moe_layer(shared=False)
        with auxiliary_loss_scale(scale):
            out = layer(x)
        (0 * out.sum()).backward()  # no language-model gradient: all the router gets is the balance loss
        grads.append(layer.router.gate.weight.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0] * 0.5)


def test_routing_loads_are_counted_once_per_backward_and_move_the_bias_toward_balance() -> None:
    """Loads: every micro-batch's routing slots, counted in backward (not by a no-grad forward, nor twice
    under activation checkpointing). Update: b_e += γ · sign(mean load − load_e), then the count resets."""
    layer = moe_layer(shared=False, balance="bias", bias_update_rate=0.25)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    _, experts, _ = layer.router(x)
    slots = torch.bincount(experts.flatten(), minlength=4)
    with torch.no_grad():
        layer(x)
    layer(x).sum().backward()
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # recomputes the forward in backward
    assert torch.equal(layer.router.expert_load, 2 * slots)

    router = layer.router
    router.expert_load.copy_(torch.tensor([6, 2, 4, 0]))  # mean 3
    after_optimizer_step([layer])
    assert torch.equal(router.expert_bias, torch.tensor([-0.25, 0.25, -0.25, 0.25]))
    assert torch.equal(router.expert_load, torch.zeros(4, dtype=torch.long))
    router.expert_load.copy_(torch.tensor([3, 3, 5, 1]))  # an expert at the mean keeps its bias
    after_optimizer_step([layer])
    assert torch.equal(router.expert_bias, torch.tensor([-0.25, 0.25, -0.5, 0.5]))
    assert "router.expert_bias" in layer.state_dict() and "router.expert_load" not in layer.state_dict()


def imbalance_curve(rate: float, steps: int = 12) -> list[float]:
    """tiny-moe trained with its routers skewed toward expert 0; per step, the worst layer's max/mean load.

    The skew: every token embedding shares a direction u, and expert 0's gate row leans along it.
    """
    cfg = ModelConfig(
        preset="tiny-moe", moe=dict(n_experts=8, top_k=2, balance="bias", bias_update_rate=rate)
    )
    model = Transformer(cfg, max_seq_len=32)
    model.init_weights(1)
    routers = [block.feed_forward.router for block in model.layers.values()]
    with torch.no_grad():
        u = F.normalize(torch.randn(128, generator=torch.Generator().manual_seed(9)), dim=0)
        model.tok_embeddings.weight += 11 * u
        for router in routers:
            router.gate.weight[0] += 0.04 * u
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    curve = []
    for _ in range(steps):
        tokens = (torch.randint(2048, (4, 1), generator=generator) + torch.arange(33)) % 2048
        token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(max((r.expert_load.max() / r.expert_load.double().mean()).item() for r in routers))
        after_optimizer_step([model])
    return curve


@pytest.mark.slow
def test_bias_balancing_evens_out_a_skewed_router_while_training() -> None:
    frozen, balanced = imbalance_curve(rate=1e-9), imbalance_curve(rate=0.02)
    assert frozen[0] == balanced[0] > 3  # the same skewed start: an expert takes over 3× its share
    late = [sum(curve[-5:]) / 5 for curve in (frozen, balanced)]
    assert late[1] < 0.8 * late[0], (frozen, balanced)


def test_presets_build_and_the_planner_counts_every_parameter() -> None:
    every_other = ModelConfig(
        **SMALL, moe=dict(n_experts=4, top_k=2, shared_experts=1, every_n_layers=2, expert_ffn_dim=16)
    )
    for cfg in (ModelConfig(preset="tiny-moe"), every_other):
        with torch.device("meta"):
            model = Transformer(cfg, max_seq_len=8)
        assert count_params(cfg).total == param_count(model)
    assert [type(block.feed_forward).__name__ for block in Transformer(every_other, 8).layers.values()] == [
        "FeedForward",
        "MoE",
        "FeedForward",
        "MoE",
    ]


def test_mixtral_8x7b_counts_match_published_total_and_active() -> None:
    # Jiang et al. 2024 (Mixtral of Experts): 46.7B parameters, 12.9B used per token.
    counts = count_params(ModelConfig(preset="mixtral-8x7b"))
    assert counts.total == pytest.approx(46.7e9, rel=0.01)
    assert counts.active == pytest.approx(12.9e9, rel=0.01)


def job(model: dict, parallel: dict | None = None, world: int = 1, **train: int) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": model,
            "parallel": parallel or {},
            "hardware": {"chips_per_node": world},
            "train": {"seq_len": 64, "global_batch_size": 8, "micro_batch_size": 2, **train},
        }
    )


def test_flops_count_active_experts_only() -> None:
    # Top-2 of 8 experts of width f/2 does the dense f-wide SwiGLU's FLOPs, plus the router's d·E.
    dense = job(SMALL)
    moe = job({**SMALL, "moe": dict(n_experts=8, top_k=2, expert_ffn_dim=32)})
    flops = [model_flops_per_token(Geometry(j.model, j.parallel, j.train, "cpu")) for j in (dense, moe)]
    assert flops[1] - flops[0] == 6 * SMALL["n_layers"] * SMALL["dim"] * 8
    counts = count_params(moe.model)  # 6 of 8 experts idle per token in each of the 4 layers
    assert counts.total - counts.active == SMALL["n_layers"] * 6 * 3 * SMALL["dim"] * 32


def test_planner_prices_the_expert_all_to_all() -> None:
    moe = {**SMALL, "moe": dict(n_experts=8, top_k=2)}
    exposed = {}
    for ep in (1, 2, 4):
        j = job(moe, dict(dp_shard=4, ep=ep), world=4)
        plan = make_plan(j.model, j.parallel, j.train, j.hardware, j.checkpoint)
        exposed[ep] = plan.time_breakdown.exposed_comm_s["ep"]
        geo = Geometry(j.model, j.parallel, j.train, "cpu")
        # Each dispatch sends the micro-batch's top_k slots of d elements, (ep−1)/ep of them off-rank;
        # 4 all-to-alls per MoE layer (dispatch, combine and their transposes), one micro-batch.
        one = 2 * 64 * 2 * SMALL["dim"] * 4 * (ep - 1) / ep
        assert all_to_all_bytes(geo) == one
        if ep > 1:
            (row,) = [p for p in plan.placement if p.dim == "ep"]
            assert row.bytes_per_step == 4 * SMALL["n_layers"] * one and row.time_s == exposed[ep]
    assert exposed[1] == 0 < exposed[2] < exposed[4]


@pytest.mark.parametrize(
    ("model", "parallel", "world", "message"),
    [
        (
            {**SMALL, "moe": dict(n_experts=6)},
            dict(dp_shard=4, ep=4),
            4,
            "parallel.ep=4 must divide model.moe.n_experts=6",
        ),
        (
            {**SMALL, "moe": dict(n_experts=8)},
            dict(dp_shard=2, tp=2, ep=4),
            4,
            "must divide parallel.dp_shard=2",
        ),
        (SMALL, dict(dp_shard=2, ep=2), 2, "needs a mixture-of-experts model; set model.moe"),
        (
            {**SMALL, "moe": dict(n_experts=4, top_k=5)},
            {},
            1,
            "model.moe.top_k=5 exceeds model.moe.n_experts=4",
        ),
        ({**SMALL, "moe": dict(n_experts=4)}, dict(compile=True), 1, "set parallel.compile=false"),
        (
            {**SMALL, "moe": dict(n_experts=4, balance="bias")},
            dict(pp=2),
            2,
            "model.moe.balance=bias with parallel.pp=2 is not supported",
        ),
        (
            {**SMALL, "moe": dict(n_experts=4, bias_update_rate=0.01)},
            {},
            1,
            "model.moe.bias_update_rate only applies with model.moe.balance='bias'",
        ),
    ],
)
def test_spec_rejects_impossible_moe_layouts_naming_field_and_fix(
    model: dict, parallel: dict, world: int, message: str
) -> None:
    with pytest.raises(ValidationError, match=message.replace(".", r"\.")):
        job(model, parallel, world)


@pytest.mark.dist
@pytest.mark.fault
@pytest.mark.cold  # the killed rank is torchrun's own child; forked, a peer's echo is logged first more often
def test_expert_parallel_run_killed_with_kill_9_resumes_on_the_uninterrupted_curve(tmp_path: Path) -> None:
    """ep=2 over 2 ranks: the last rank SIGKILLs itself at step 6, torchrun restarts both, they resume
    from step 4's checkpoint (experts sharded over ep, routing biases saved with the weights) and train
    exactly the uninterrupted run's curve: bitwise, since the layout and so every reduction order is the
    same. The bias rate is large so that the biases steer routing within these 8 steps."""
    moe = {"n_experts": 4, "top_k": 2, "shared_experts": 1, "balance": "bias", "bias_update_rate": 0.05}
    spec = spec_with(
        model={**MICRO_MODEL, "moe": moe},
        parallel={"dp_shard": 2, "ep": 2},
        faults={"max_restarts": 1},
        # Sync, as in test_train's crash tests: step 4's checkpoint is committed before the fault at
        # step 6 however loaded the box (an async one may still be in flight, and the run then resumes
        # from step 0: the same curve, but not the resume this test is about).
        checkpoint={"mode": "sync"},
    )
    curves, biases, output = {}, {}, ""
    for name, faults in (("whole", {}), ("killed", {"TESSERA_FAULT_CRASH_AT_STEP": "6"})):
        returncode, output = tessera_train(spec, tmp_path / name, faults)
        assert returncode == 0, output[-4000:]
        curves[name] = curve(tmp_path / name)
        _, model = load_model(resolve_step(str(tmp_path / name / "checkpoints")), job_of(spec))
        biases[name] = [block.feed_forward.router.expert_bias for block in model.layers.values()]
    assert lost_a_rank_to_sigkill(output) and "resumed from step 4" in output
    assert len(curves["whole"]) == 8 and curves["killed"] == curves["whole"]
    # The biases swing by ±0.05 a step (some may be back at 0 by step 8); the resumed run's are the same.
    assert any(bias.abs().max() > 0 for bias in biases["whole"])
    assert all(torch.equal(a, b) for a, b in zip(biases["killed"], biases["whole"], strict=True))

"""The DeepSeek family: MLA against hand-written attention, its published sizes, its block layout and
router, what the spec refuses, the planner's pricing of MLA, and a tiny model that learns."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from pydantic import ValidationError

from tests.test_plan import _saved_activation_bytes
from trainer.config import (
    LATER_MODEL_DEFAULTS,
    LATER_MOE_DEFAULTS,
    JobConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)
from trainer.models import family_of, param_count
from trainer.models.deepseek import DEEPSEEK
from trainer.models.deepseek.model import DeepSeekBlock, LatentAttention
from trainer.models.documents import find_documents
from trainer.models.llama.model import FeedForward, rope_table
from trainer.models.moe import MoE, Router
from trainer.plan.flops import model_flops_per_token
from trainer.plan.hbm import layer_activation_bytes
from trainer.plan.layout import Geometry
from trainer.rank.step_hooks import after_optimizer_step

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "deployments/specs/local-cpu-deepseek.yaml"
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
# A DeepSeek of our own (dense: every FFN the same width, so one block is the planner's mean block).
DENSE = dict(
    preset="deepseek-custom",
    n_layers=2,
    dim=32,
    n_heads=4,
    n_kv_heads=4,
    ffn_dim=48,
    vocab_size=64,
    rope_theta=1e4,
    mla=MLA,
)


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE written with complex numbers: channel pairs (2i, 2i+1) of x [B, T, H, r] turned by pos·θ^(-2i/r)."""
    seq, width = x.shape[1], x.shape[-1]
    freqs = theta ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    turn = torch.polar(
        torch.ones(seq, width // 2, dtype=torch.float64), torch.outer(torch.arange(seq), freqs)
    )
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * turn[None, :, None]).flatten(-2).to(x.dtype)


def reference_mla(layer: LatentAttention, x: torch.Tensor, theta: float, mask: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2 §2.1 written out per head: scores materialized, scaled by 1/sqrt(nope + rope), masked."""
    batch, seq, _ = x.shape
    nope, rope, v_dim = layer.nope, layer.rope_dim, layer.v_dim
    if layer.wq is None:
        q = layer.wq_b(F.rms_norm(x @ layer.wq_a.weight.T, (layer.wq_a.out_features,), layer.q_norm.weight))
    else:
        q = x @ layer.wq.weight.T
    q = q.view(batch, seq, -1, nope + rope)
    heads = q.shape[2]
    c_kv, k_pe = (x @ layer.wkv_a.weight.T).split([layer.kv_rank, rope], dim=-1)
    c_kv = F.rms_norm(c_kv, (layer.kv_rank,), layer.kv_norm.weight, eps=layer.kv_norm.eps)
    kv = (c_kv @ layer.wkv_b.weight.T).view(batch, seq, heads, nope + v_dim)
    q_pe, k_pe = rotate(q[..., nope:], theta), rotate(k_pe[:, :, None], theta)
    outputs = []
    for h in range(heads):
        qh = torch.cat((q[:, :, h, :nope], q_pe[:, :, h]), dim=-1)
        kh = torch.cat((kv[:, :, h, :nope], k_pe[:, :, 0]), dim=-1)
        scores = (qh @ kh.transpose(1, 2)) / math.sqrt(nope + rope)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outputs.append(probs @ kv[:, :, h, nope:])
    return torch.cat(outputs, dim=-1) @ layer.wo.weight.T


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["low_rank_query", "plain_query"])
def test_latent_attention_is_deepseeks_formula_causal_and_within_documents(q_lora_rank: int | None) -> None:
    cfg = ModelConfig(**{**DENSE, "mla": {**MLA, "q_lora_rank": q_lora_rank}})
    torch.manual_seed(0)
    layer = LatentAttention(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seq = 12
    x = torch.randn(2, seq, cfg.dim)
    rope = rope_table(MLA["qk_rope_head_dim"], seq, cfg.rope_theta)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    torch.testing.assert_close(
        layer(x, rope), reference_mla(layer, x, cfg.rope_theta, causal), rtol=1e-5, atol=1e-5
    )
    tokens = torch.tensor([[5, 0, 7, 7, 0, 3, 3, 3, 1, 0, 2, 2], [1] * seq])
    docs = find_documents(tokens, eos_id=0)
    expected = reference_mla(layer, x, cfg.rope_theta, docs.dense[:, 0])
    torch.testing.assert_close(layer(x, rope, docs), expected, rtol=1e-5, atol=1e-5)


def test_first_dense_layers_then_routed_and_shared_experts() -> None:
    model = DEEPSEEK.build(ModelConfig(preset="tiny-deepseek"), 16)
    kinds = [type(block.feed_forward) for block in model.layers.values()]
    assert kinds == [FeedForward, MoE, MoE, MoE]
    assert all(isinstance(block, DeepSeekBlock) for block in model.layers.values())
    assert model.layers["1"].feed_forward.shared.w1.out_features == 64  # one shared expert, 64 wide


def test_sigmoid_router_normalises_then_scales_and_v2_lite_leaves_weights_unnormalised() -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    v3 = Router(16, MoEConfig(n_experts=8, top_k=3, score="sigmoid", routed_scale=2.5, balance="bias"))
    v3.expert_bias.copy_(torch.linspace(-1, 1, 8))
    weights, experts, _ = v3(x)
    scores = v3.gate(x).sigmoid().flatten(0, 1)
    chosen = (scores + v3.expert_bias).topk(3).indices
    top = scores.gather(-1, chosen)
    assert torch.equal(experts, chosen)
    torch.testing.assert_close(weights, 2.5 * top / top.sum(-1, keepdim=True))
    lite = Router(16, MoEConfig(n_experts=8, top_k=3, normalize_weights=False))
    weights, experts, _ = lite(x)
    torch.testing.assert_close(weights, lite.gate(x).softmax(-1).flatten(0, 1).gather(-1, experts))


def test_published_sizes_are_counted_from_the_released_configs() -> None:
    """DeepSeek-V3: 671B in all (paper §4.2); 36.6B active per the release's README_WEIGHTS.md, which
    counts the output head (0.9B) but not the input embedding's lookup (the paper rounds this to 37B).
    DeepSeek-V2-Lite: 15.7B in all; 2.4B active in the paper, which the released config.json gives as
    2.45B counted the same way: the paper's figure is cut to one decimal, not rounded."""
    v3 = family_of(ModelConfig(preset="deepseek-v3")).count_params(ModelConfig(preset="deepseek-v3"))
    assert v3.total == pytest.approx(671e9, rel=0.01)
    assert v3.active - v3.embedding == pytest.approx(36.6e9, rel=0.01)
    lite = DEEPSEEK.count_params(ModelConfig(preset="deepseek-v2-lite"))
    assert lite.total == pytest.approx(15.7e9, rel=0.01)
    assert 2.4e9 <= lite.active - lite.embedding < 2.5e9
    # By hand: 27 MLA layers, 1 dense SwiGLU, 26 MoE layers with 6 routed + 2 shared experts active.
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048 + 512 + 2 * 2048
    moe = 2048 * 64 + 8 * 3 * 2048 * 1408
    assert lite.active - lite.embedding == 27 * attention + 3 * 2048 * 10944 + 26 * moe + 2048 + 102400 * 2048


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"mla": {**MLA, "q_lora_rank": None}},
        {
            "moe": {
                "n_experts": 4,
                "top_k": 2,
                "shared_experts": 2,
                "expert_ffn_dim": 16,
                "first_dense_layers": 1,
            }
        },
        {"n_layers": 5, "moe": {"n_experts": 4, "every_n_layers": 2, "first_dense_layers": 2}},
        {"tie_embeddings": True},
    ],
    ids=["dense", "plain_query", "first_dense", "every_other_after_two", "tied"],
)
def test_count_params_is_the_built_modules_count_exactly(changes: dict) -> None:
    cfg = ModelConfig(**{**DENSE, **changes})
    with torch.device("meta"):
        model = DEEPSEEK.build(cfg, 16)
    counts = DEEPSEEK.count_params(cfg)
    assert counts.total == param_count(model)
    routed = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    assert counts.routed == routed
    moe_layers = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    assert cfg.moe_layer_count == len(moe_layers)


def test_tiny_preset_counts_and_llama_fingerprints_stay() -> None:
    cfg = ModelConfig(preset="tiny-deepseek")
    with torch.device("meta"):
        assert param_count(DEEPSEEK.build(cfg, 16)) == DEEPSEEK.count_params(cfg).total
    # Llama MoE presets hash as before the MoE options existed (their defaults are left out).
    job = JobConfig(model={"preset": "tiny-moe"})
    shape = job.model.model_dump()
    for name in LATER_MODEL_DEFAULTS:  # attention, rope_positions, mla, qkv_bias, qk_norm, rope_scaling
        del shape[name]
    for name in LATER_MOE_DEFAULTS:
        del shape["moe"][name]
    assert (
        job.model_fingerprint() == hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    )


@pytest.mark.parametrize(
    ("model", "parallel", "world", "message"),
    [
        (
            {"preset": "tiny-deepseek"},
            {"tp": 2},
            2,
            "parallel.tp=2: the DeepSeek family has no tensor-parallel plan",
        ),
        (
            {"preset": "tiny-deepseek"},
            {"cp": 2},
            2,
            "parallel.cp=2: the DeepSeek family has no ring attention",
        ),
        ({"preset": "tiny", "mla": MLA}, {}, 1, "model.mla (multi-head latent attention) is DeepSeek's"),
        ({**DENSE, "n_kv_heads": 2}, {}, 1, "model.n_kv_heads=2 must equal model.n_heads=4"),
        (
            {k: v for k, v in DENSE.items() if k != "mla"},
            {},
            1,
            "model.preset=deepseek-custom is a DeepSeek model and needs model.mla",
        ),
        ({**DENSE, "dim": None}, {}, 1, "model.preset=deepseek-custom needs model.dim"),
    ],
)
def test_the_spec_refuses_what_the_family_cannot_do_naming_field_and_fix(
    model: dict, parallel: dict, world: int, message: str
) -> None:
    with pytest.raises(
        ValidationError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")
    ):
        JobConfig.model_validate(
            {
                "model": {k: v for k, v in model.items() if v is not None},
                "parallel": parallel,
                "hardware": {"chips_per_node": world},
            }
        )
    muon = {"model": {"preset": "deepseek-custom", **DENSE}, "optimizer": {"name": "muon"}}
    with pytest.raises(
        ValidationError, match=r"optimizer\.name=muon is not wired for multi-head latent attention"
    ):
        JobConfig.model_validate(muon)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["low_rank_query", "plain_query"])
def test_planner_prices_mla_activations_exactly_and_its_flops(q_lora_rank: int | None) -> None:
    """Every tensor autograd saves in one MLA block (fp32 and bf16) is the planner's A_layer; model FLOPs
    are 6N + 6·L·s·H·(d_qk + d_v) (12·L·s·d when d_qk = d_v = d/H, as for Llama)."""
    cfg = ModelConfig(**{**DENSE, "mla": {**MLA, "q_lora_rank": q_lora_rank}})
    batch, seq = 2, 64
    rope = rope_table(MLA["qk_rope_head_dim"], seq, cfg.rope_theta)
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
        train = TrainConfig(seq_len=seq, global_batch_size=batch, micro_batch_size=batch)
        geo = Geometry(cfg, ParallelConfig(mixed_precision=precision), train, "cpu")
        assert _saved_activation_bytes(DeepSeekBlock(cfg, 0).to(dtype), x, rope) == sum(
            layer_activation_bytes(geo)
        )
    heads, widths = cfg.n_heads, MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"] + MLA["v_head_dim"]
    assert model_flops_per_token(geo) == 6 * geo.counts.matmul + 6 * cfg.n_layers * seq * heads * widths


def test_the_planner_prices_deepseek_v3_on_h100s() -> None:
    """V3 on 256 H100s: FSDP over all of them, experts over ep=64 (DeepSeek trained with 64-way EP). Its
    61 layers split over no pipeline evenly, so pp=1. Model FLOPs: 6 per active weight a token
    multiplies (36.6B, the head included) plus MLA's attention, 6·L·s·H·(192 + 128)."""
    from trainer.config import CheckpointConfig, HardwareConfig
    from trainer.layout_checks import layout_errors
    from trainer.plan import make_plan

    model = ModelConfig(preset="deepseek-v3")
    parallel = ParallelConfig(dp_shard=256, ep=64, mixed_precision="bf16", activation_checkpointing="full")
    train = TrainConfig(seq_len=4096, global_batch_size=1024, micro_batch_size=1)
    hardware = HardwareConfig(accelerator="gpu", chip="h100-sxm", nodes=32, chips_per_node=8)
    assert not layout_errors(model, parallel, train, hardware)
    plan = make_plan(model, parallel, train, hardware, CheckpointConfig())
    attention = 6 * 61 * 4096 * 128 * (192 + 128)
    assert plan.flops_per_token == pytest.approx(6 * 36.6e9 + attention, rel=0.01)
    assert plan.fits and 0 < plan.mfu < 1, plan.memory_per_chip_bytes


def test_tiny_deepseek_from_the_spec_example_learns() -> None:
    """The spec example's model, one process, AdamW with the bias balancing's step hook, half its batch
    and sequence (a quick test): the loss on counting sequences falls by more than half in 30 steps."""
    spec = yaml.safe_load(SPEC.read_text())
    job = JobConfig.model_validate({"model": spec["model"], "train": spec["train"]})
    torch.manual_seed(0)
    model = family_of(job.model).build(job.model, job.train.seq_len)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    vocab, seq, batch = job.model.vocab_size, job.train.seq_len // 2, job.train.global_batch_size // 2
    losses = []
    for step in range(30):
        starts = torch.randint(vocab, (batch, 1), generator=torch.Generator().manual_seed(step))
        tokens = (starts + torch.arange(seq + 1)) % vocab
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        after_optimizer_step([model])
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, losses
    biases = [block.feed_forward.router.expert_bias for block in list(model.layers.values())[1:]]
    assert all(b.abs().sum() > 0 for b in biases), "the auxiliary-loss-free bias moved"

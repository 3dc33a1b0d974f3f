"""The Llama-style decoder alone: shapes, preset sizes, deterministic init, causality, GQA, RoPE, stages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dispatch import RecordOps
from trainer.config import JobConfig, ModelConfig
from trainer.models import param_count
from trainer.models.llama.model import Attention, Transformer, apply_rope, rope_table
from trainer.parallel.pipeline import split_stage

TINY = ModelConfig(
    preset="custom", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, rope_theta=1e4
)
SEQ = 12


def build(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    model = Transformer(cfg, max_seq_len=SEQ)
    model.init_weights(seed)
    return model


def tokens(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(TINY.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def test_forward_gives_logits_per_position() -> None:
    logits = build()(tokens(3))
    assert logits.shape == (3, SEQ, TINY.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("preset", "billions"), [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9)]
)
def test_llama3_presets_build_on_meta_with_published_sizes(preset: str, billions: float) -> None:
    with torch.device("meta"):
        model = Transformer(ModelConfig(preset=preset), max_seq_len=8192)
    assert param_count(model) / 1e9 == pytest.approx(billions, rel=0.01)


def test_init_is_deterministic_per_seed_and_survives_meta_materialization() -> None:
    reference = build(seed=3)
    with torch.device("meta"):
        model = Transformer(TINY, max_seq_len=SEQ)
    model.to_empty(device="cpu")
    model.init_weights(3)
    for (name, expected), actual in zip(
        reference.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(expected, actual), name
    assert torch.equal(reference.rope, model.rope)
    assert not torch.equal(
        build(seed=4).layers["0"].attention.wq.weight, reference.layers["0"].attention.wq.weight
    )


def test_rope_table_is_a_buffer_not_checkpoint_state() -> None:
    model = build()
    assert "rope" not in model.state_dict()
    assert model.rope.shape == (SEQ, TINY.head_dim // 2, 2)


def test_future_tokens_do_not_change_past_logits() -> None:
    model = build()
    x = tokens()
    changed = x.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % TINY.vocab_size
    before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_rope_scores_depend_only_on_relative_position() -> None:
    rope = rope_table(TINY.head_dim, 32, TINY.rope_theta)
    q, k = torch.randn(2, 1, 1, TINY.head_dim).unbind(0)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        def at(x: torch.Tensor, pos: int) -> torch.Tensor:
            return apply_rope(x[:, None].expand(1, pos + 1, 1, -1).contiguous(), rope)[0, pos, 0]

        return at(q, q_pos) @ at(k, k_pos)

    torch.testing.assert_close(score(5, 2), score(20, 17))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_grouped_query_attention_matches_explicit_softmax_attention() -> None:
    attention = Attention(TINY)
    x = torch.randn(2, SEQ, TINY.dim)
    rope = rope_table(TINY.head_dim, SEQ, TINY.rope_theta)
    head = TINY.head_dim
    q = apply_rope(attention.wq(x).view(2, SEQ, TINY.n_heads, head), rope).transpose(1, 2)
    k = apply_rope(attention.wk(x).view(2, SEQ, TINY.n_kv_heads, head), rope).transpose(1, 2)
    v = attention.wv(x).view(2, SEQ, TINY.n_kv_heads, head).transpose(1, 2)
    # Query head h reads key/value head h // (n_heads / n_kv_heads).
    group = TINY.n_heads // TINY.n_kv_heads
    k, v = k[:, [h // group for h in range(TINY.n_heads)]], v[:, [h // group for h in range(TINY.n_heads)]]
    scores = (q @ k.transpose(-1, -2)) / head**0.5
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    expected = attention.wo((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, SEQ, -1))
    torch.testing.assert_close(attention(x, rope), expected)


def test_grouped_query_attention_reads_key_and_value_heads_without_copying_them() -> None:
    attention, rope = Attention(TINY), rope_table(TINY.head_dim, SEQ, TINY.rope_theta)
    x = torch.randn(2, SEQ, TINY.dim)
    with RecordOps() as ops:
        attention(x, rope).sum().backward()
    assert not ops.ran("repeat_interleave") and not ops.ran("index_select"), [op for op, _ in ops.outputs]


def fp32_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE as the definition reads: upcast, rotate each pair, cast back."""
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rope[None, : x.shape[1], None].unbind(-1)
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_fp32_rotation_bit_for_bit_without_an_fp32_copy(dtype: torch.dtype) -> None:
    rope = rope_table(TINY.head_dim, SEQ, TINY.rope_theta)
    x = torch.randn(2, SEQ, TINY.n_heads, TINY.head_dim).to(dtype).requires_grad_()
    grad = torch.randn(x.shape).to(dtype)
    with RecordOps() as ops:
        out = apply_rope(x, rope)
        (x_grad,) = torch.autograd.grad(out, x, grad)
    expected = fp32_rope(x, rope)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    assert torch.equal(out, expected) and torch.equal(x_grad, expected_grad)
    if dtype == torch.bfloat16:  # fp32 only in half-width products, never a copy of x or of the result
        assert ops.largest(torch.float32) == x.numel() // 2


def test_tied_embeddings_share_one_matrix() -> None:
    tied = TINY.model_copy(update={"tie_embeddings": True})
    model = build(tied)
    assert model.output.weight is model.tok_embeddings.weight
    assert param_count(build()) - param_count(model) == TINY.vocab_size * TINY.dim


def test_tied_embeddings_with_pipeline_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"model\.tie_embeddings needs parallel\.pp=1"):
        JobConfig.model_validate(
            {
                "model": {"tie_embeddings": True},
                "parallel": {"pp": 2},
                "train": {"global_batch_size": 8, "micro_batch_size": 2},
                "hardware": {"chips_per_node": 2},
            }
        )


def test_pipeline_stages_chain_to_the_full_model_with_the_same_names() -> None:
    model = build()
    stages = [split_stage(model, stage, 4) for stage in range(4)]
    h = tokens()
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(tokens()))
    names = [set(stage.state_dict()) for stage in stages]
    assert set().union(*names) == set(model.state_dict())
    assert sum(len(n) for n in names) == len(model.state_dict()), "stages must not share parameters"


def test_a_stage_initialized_alone_gets_the_full_models_values() -> None:
    with torch.device("meta"):
        stage = split_stage(Transformer(TINY, max_seq_len=SEQ), 2, 4)
    stage.to_empty(device="cpu")
    stage.init_weights(0)
    full = build().state_dict()
    for name, value in stage.state_dict().items():
        assert torch.equal(value, full[name]), name

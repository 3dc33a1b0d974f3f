"""The fused head-and-loss gives the plain loss's values and gradients without holding the logits."""

from __future__ import annotations

import pytest
import torch

from tests.dispatch import RecordOps
from trainer.config import ModelConfig
from trainer.models.llama.model import Transformer, canonical_fqn
from trainer.plan.hbm import MIN_CHUNK_TOKENS
from trainer.rank.loss import linear_cross_entropy, token_loss

TINY = ModelConfig(
    preset="custom", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, rope_theta=1e4
)


def head_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 32, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(256, 32, generator=generator) * 32**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(256, (3, 10), generator=generator)
    return hidden, weight, targets


def loss_and_grads(loss_fn, dtype: torch.dtype, scale: float) -> list[torch.Tensor]:
    hidden, weight, targets = head_inputs(dtype)
    loss = loss_fn(hidden, weight, targets)
    (loss * scale).backward()  # as gradient accumulation scales each micro-batch's loss
    return [loss.detach(), hidden.grad, weight.grad]


@pytest.mark.parametrize("rows", [None, 1, 7, 30, 64])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_chunked_loss_matches_the_plain_loss_and_its_gradients(
    rows: int | None, dtype: torch.dtype, tolerance: float
) -> None:
    def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(hidden @ weight.T, targets)

    def chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, targets, rows)

    expected, actual = loss_and_grads(plain, dtype, 1 / 3), loss_and_grads(chunked, dtype, 1 / 3)
    for name, want, got in zip(("loss", "hidden grad", "weight grad"), expected, actual, strict=True):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=name)


def test_without_gradients_the_chunked_loss_computes_none() -> None:
    hidden, weight, targets = head_inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, rows=4)
    torch.testing.assert_close(loss, token_loss(hidden @ weight.T, targets).detach())


def test_the_model_with_targets_returns_the_loss_of_its_logits_and_never_holds_them() -> None:
    model = Transformer(TINY, max_seq_len=16)
    model.init_weights(0)
    # 512 tokens: two chunks of MIN_CHUNK_TOKENS.
    tokens = torch.randint(TINY.vocab_size, (32, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    plain = token_loss(model(inputs), targets)
    plain.backward()
    plain_grads = {canonical_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with RecordOps() as ops:
        fused = model(inputs, targets)
        fused.backward()

    torch.testing.assert_close(fused, plain.detach())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[canonical_fqn(name)], msg=name)
    assert ops.largest() == MIN_CHUNK_TOKENS * TINY.vocab_size == inputs.numel() * TINY.vocab_size / 2

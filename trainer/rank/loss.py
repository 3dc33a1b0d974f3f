"""The training loss, mean next-token cross-entropy in fp32 whatever the compute dtype, two ways.

:func:`token_loss` takes logits. Tensor parallelism's head leaves them split over the vocabulary
(torch's ``loss_parallel`` reduces the softmax over tp ranks), and a pipeline's last stage hands
its logits to the schedule's loss, so those layouts use it.

:func:`linear_cross_entropy` takes the last hidden states and the output projection instead and
never holds more than one chunk of logits (Liger's fused linear cross-entropy, in plain torch).
The plain path holds all T·V logits of a micro-batch in the compute dtype, an fp32 copy and the
fp32 log-softmax it saves for backward: ~10 GB for 32K tokens at vocab 32K, ~40 GB at 128K. Here
each chunk's gradients are computed in the forward pass, while its logits exist, so backward only
scales them: the same three matmuls as the plain head, no recompute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.plan.hbm import loss_chunk_tokens


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all tokens of logits [B, T, V], in fp32.

    Under tensor parallelism the logits are a DTensor split over the vocabulary, and this (and its
    backward) must run inside ``trainer.parallel.loss_context``; the loss is then a replicated DTensor."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, rows: int | None = None) -> Tensor:
    """``token_loss(hidden @ weight.T, targets)`` without the logits: hidden [B, T, D], weight [V, D].

    rows: tokens per chunk; by default a chunk's logits have about as many elements as ``hidden``
    (Liger's rule: the head then needs no more memory than the activation it reads), and at least
    ``trainer.plan.hbm.MIN_CHUNK_TOKENS``.
    """
    hidden, targets = hidden.flatten(0, 1), targets.flatten()
    vocab, dim = weight.shape
    rows = rows or loss_chunk_tokens(hidden.shape[0], vocab, dim)
    with_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, targets, rows, with_grads)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, rows: int, with_grads: bool
    ) -> Tensor:
        n_tokens = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grads and hidden.requires_grad else None
        # fp32 whatever the weight's dtype: the sum over chunks must not round at every chunk.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if with_grads and weight.requires_grad
            else None
        )
        for start in range(0, n_tokens, rows):
            chunk, target = hidden[start : start + rows], targets[start : start + rows, None]
            logits = (chunk @ weight.T).float()  # rounded to the compute dtype first, as the plain head's
            lse = logits.logsumexp(-1, keepdim=True)
            total += (lse - logits.gather(-1, target)).sum()
            if not with_grads:
                continue
            # d(mean loss)/d(logits) = (softmax - one_hot(target)) / N, built in place in the logits.
            grad = logits.sub_(lse).exp_().scatter_add_(-1, target, logits.new_full(target.shape, -1.0))
            grad = grad.div_(n_tokens).to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[start : start + rows])
            if grad_weight is not None:
                grad_weight.add_(grad.T @ chunk)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / n_tokens

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        # Scaled in fp32, then rounded once to the parameter's / activation's dtype.
        if grad_hidden is not None:
            grad_hidden = (grad_hidden.float() * grad_loss).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None

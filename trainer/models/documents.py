"""Document masking: attention that stays inside each document packed into a sample.

Samples are documents back to back, each ended by the end-of-text token (``trainer/data/pack.py``),
so a document starts at a row's first token and right after each EOS, and each EOS belongs to the
document it closes. :func:`find_documents` works that out once per micro-batch from the token ids, and every
attention layer of the forward reuses it.

Two kernels compute the same mask. Where FlexAttention trains (CUDA: compiled to Triton, with a
backward), the mask is a ``BlockMask`` and flex skips every 128×128 block that lies outside all
documents, so attention costs the sum of the documents' squared lengths rather than the sample's. In
torch 2.13 FlexAttention has no backward on CPU, eager or compiled ("FlexAttention does not support
backward on CPU"), so elsewhere the mask is a dense boolean [B, 1, T, T] tensor given to SDPA: the same
numbers, with every block computed (about twice causal attention's work) and B·T² bytes held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# Devices whose FlexAttention has a backward (Triton kernels); the rest train on a dense mask.
FLEX_DEVICES = ("cuda",)


@dataclass(frozen=True)
class Documents:
    """The documents of one micro-batch [B, T]: each token's position within its document, and the
    mask every attention layer applies (``block_mask`` on FLEX_DEVICES, else ``dense``)."""

    positions: Tensor  # [B, T] int64, each token's offset from its document's first token
    block_mask: BlockMask | None
    dense: Tensor | None  # [B, 1, T, T] bool, True where a query may attend to a key


def find_documents(tokens: Tensor, eos_id: int | None) -> Documents:
    """Documents of ``tokens`` [B, T]; ``eos_id`` None (no dataset, e.g. synthetic tokens): one per row."""
    seq = tokens.shape[1]
    steps = torch.arange(seq, device=tokens.device)
    ends = tokens == eos_id if eos_id is not None else torch.zeros_like(tokens, dtype=torch.bool)
    # A document starts at position 0 and right after each EOS.
    starts = torch.cat((torch.ones_like(ends[:, :1]), ends[:, :-1]), dim=1)
    ids = (starts.cumsum(1) - 1).to(torch.int32)
    first = torch.where(starts, steps, 0).cummax(1).values
    if tokens.device.type in FLEX_DEVICES:
        return Documents(steps - first, document_block_mask(ids), None)
    dense = (ids[:, :, None] == ids[:, None, :]) & (steps[:, None] >= steps[None, :])
    return Documents(steps - first, None, dense[:, None])


def document_block_mask(ids: Tensor) -> BlockMask:
    """Flex's mask of document ids [B, T]: a query sees earlier keys of its own document. Shared by
    every head (H=None), so tensor parallelism's head split leaves it whole."""

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    batch, seq = ids.shape
    return create_block_mask(mask_mod, batch, None, seq, seq, device=ids.device)


def document_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents) -> Tensor:
    """Grouped-query attention of q [B, H, T, hd] over k, v [B, H_kv, T, hd] within each document."""
    if docs.block_mask is not None:
        return _compiled_flex()(q, k, v, block_mask=docs.block_mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.dense, enable_gqa=True)


@cache
def _compiled_flex() -> Callable[..., Tensor]:
    """Compiled once per process: eager flex runs a reference that materializes the scores."""
    return torch.compile(flex_attention)

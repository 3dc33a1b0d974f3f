"""DeepSeek-V2/V3's decoder: multi-head latent attention (MLA) and, after the first dense layers, a
mixture of routed and shared experts (``trainer/models/moe.py``).

Architecture only, built on Llama's decoder (``trainer/models/llama/model.py``: embedding, pre-norm
residual blocks, head and loss, deterministic init by parameter name), whose block it swaps for MLA's.
Parameter shapes follow the released checkpoints so the Hugging Face mapping (``hf.py``) only renames:

- queries: ``wq`` [H·(nope+rope), d], or low rank ``wq_a`` [q_rank, d] → ``q_norm`` → ``wq_b``;
- keys and values: ``wkv_a`` [kv_rank + rope, d] makes the latent (first kv_rank rows) and the RoPE key
  shared by all heads (last rope rows); ``kv_norm`` → ``wkv_b`` [H·(nope+v), kv_rank] rebuilds each
  head's non-rotary key and its value (per head: nope rows, then v rows);
- a head's query and key are [nope | rope]; softmax scales scores by 1/sqrt(nope + rope), SDPA's
  default for that width.

RoPE rotates adjacent channel pairs, which is DeepSeek's own layout (its reference code de-interleaves
before rotating halves; transformers' ``rope_interleave``), so weights need no permutation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.config import ModelConfig
from trainer.models.documents import Documents, document_attention
from trainer.models.llama.model import Transformer, apply_rope, causal_attention, feed_forward


class LatentAttention(nn.Module):
    """Causal MLA, within each document when given the micro-batch's documents."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla, heads, dim = cfg.mla, cfg.n_heads, cfg.dim
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank = mla.kv_lora_rank
        q_width = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.wq: nn.Linear | None = nn.Linear(dim, q_width, bias=False)
        else:
            self.wq_a = nn.Linear(dim, mla.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(mla.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, q_width, bias=False)
            self.wq = None
        self.wkv_a = nn.Linear(dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor, docs: Documents | None = None) -> Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq, -1, self.nope + self.rope_dim)
        heads = q.shape[2]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope).expand(-1, -1, heads, -1)
        q, k = torch.cat((q_nope, q_rope), dim=-1), torch.cat((k_nope, k_rope), dim=-1)
        # Fused kernels (flash, FlexAttention) want one head width: zero-pad v to the query/key width,
        # which adds zero columns to the output, then drop them. The scale stays 1/sqrt(nope + rope).
        pad = q.shape[-1] - self.v_dim
        v = F.pad(v, (0, pad)) if pad > 0 else v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = causal_attention(q, k, v) if docs is None else document_attention(q, k, v, docs)
        out = out[..., : self.v_dim] if pad > 0 else out
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class DeepSeekBlock(nn.Module):
    """Pre-norm residual block: x + MLA(norm(x)), then + ffn(norm(.)) (dense SwiGLU or MoE)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LatentAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = feed_forward(cfg, layer)

    def forward(self, x: Tensor, rope: Tensor, docs: Documents | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, docs)
        return h + self.feed_forward(self.ffn_norm(h))


class DeepSeekTransformer(Transformer):
    """Llama's decoder with DeepSeek's blocks; RoPE rotates only the qk_rope_head_dim channels."""

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DeepSeekBlock(cfg, layer)

    def rope_head_dim(self) -> int:
        return self.cfg.mla.qk_rope_head_dim

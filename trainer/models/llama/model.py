"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings.

Architecture only; parallelisms live in ``trainer.parallel``. Blocks sit in an ``nn.ModuleDict`` keyed
by their global layer index, and ``tok_embeddings`` / ``norm`` / ``output`` may be ``None`` (pipeline
stages delete what they do not own), so parameter FQNs are the same on every layout and a checkpoint
saved on one layout loads on another.

Build on ``meta`` and call :meth:`Transformer.init_weights` after materializing: every tensor is
(re)initialized from a generator seeded by (seed, parameter FQN), so a parameter gets the same values
whichever pipeline stage or process initializes it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.config import ModelConfig, RopeScaling
from trainer.models.documents import Documents, document_attention, find_documents
from trainer.models.moe import MoE
from trainer.rank.loss import linear_cross_entropy, token_loss

# Small init for projections (GPT-2 / Llama practice); residual outputs shrink with depth so the
# residual stream's variance at init does not grow with the number of blocks.
INIT_STD = 0.02
# Devices whose parameters draw their init on the device, from its own seeded generator: a host core
# draws ~1e8 normals/s one after another (~10 s for a 1B model, then a host-to-device copy), a GPU
# draws them in milliseconds. Values then depend on (seed, name, shard offset, device type): a CUDA
# run starts from other values than a CPU run of the same seed, each the same on every layout that
# initializes whole and on every rerun. Other devices draw on the host, so that no backend needs a
# seeded generator of its own.
DEVICE_DRAWN = ("cuda",)
# Wrappers that prefix FQNs (activation checkpointing, torch.compile); stripped to name a parameter.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def rope_table(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: RopeScaling | None = None,
) -> Tensor:
    """cos/sin of every (position, frequency) pair: [max_seq_len, head_dim // 2, 2], fp32, with the
    frequencies scaled as Llama 3.1's when ``scaling`` (``model.rope_scaling``) is given.

    Real-valued rather than complex so it works on every backend (XLA and Neuron lack complex ops).
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        freqs = llama3_frequencies(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def llama3_frequencies(freqs: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1's scaled RoPE frequencies (Meta's ``apply_scaling``; HF's ``_compute_llama3_parameters``):
    long wavelengths slowed by factor, short ones kept, the band between interpolated."""
    original, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelength = 2 * math.pi / freqs
    slowed = torch.where(wavelength > original / low, freqs / scaling.factor, freqs)
    smooth = (original / wavelength - low) / (high - low)
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, (1 - smooth) * slowed / scaling.factor + smooth * slowed, slowed)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate adjacent channel pairs of x [B, T, H, head_dim] by position (Llama's pairing), in fp32.

    rope: the table [max_seq_len, head_dim // 2, 2] (row positions 0..T-1), or each row's own rows of it
    [B, T, head_dim // 2, 2] (positions that restart at every document).
    """
    table = rope[:, :, None] if rope.dim() == 4 else rope[None, : x.shape[1], None]
    cos, sin = table.unbind(-1)
    if torch.compiler.is_compiling():
        # Inductor fuses the plain form into one kernel anyway, and AOTAutograd's cache (what spares a
        # resumed run the retracing) refuses graphs holding an autograd.Function.
        real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
        return rotated.flatten(-2).type_as(x)
    return _Rope.apply(x, cos, sin)


class _Rope(torch.autograd.Function):
    """RoPE computed in fp32 and written straight into x's dtype, with no fp32 copy of x or of the
    result: each product reads x's dtype against the fp32 table (type promotion), and each rotated
    half is rounded once into x's dtype. Its gradient is the inverse rotation. The same values as
    upcasting x, rotating and casting back, forward and backward, with about half the memory traffic
    in eager mode (under compile, Inductor fuses either into one kernel)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    # Contiguous halves in x's dtype (Dynamo refuses a strided out=), interleaved by one stack.
    out_real, out_imag = torch.empty_like(real), torch.empty_like(imag)
    torch.sub(real * cos, imag * sin, out=out_real)
    torch.add(real * sin, imag * cos, out=out_imag)
    return torch.stack((out_real, out_imag), dim=-1).flatten(-2)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal SDPA of q [B, H, T, head_dim] over k, v [B, H_kv, T, head_dim]; H / H_kv query heads share
    each key/value head. ``enable_gqa`` lets the flash and cuDNN kernels read each key/value head in
    place for its query heads; a ``repeat_interleave`` copy would write and read H / H_kv times its
    bytes per layer, forward and backward (and the math kernel makes that copy itself)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """Causal grouped-query attention, within each document when given the micro-batch's documents;
    n_heads / n_kv_heads query heads share each key/value head. ``model.qkv_bias`` adds biases to the
    q, k and v projections (Qwen2); ``model.qk_norm`` RMS-normalizes each query and key head before
    RoPE, with gains over head_dim shared by the heads (Qwen3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        # Pluggable so context parallelism can swap in ring attention over its sequence chunks.
        self.attend: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention

    def forward(self, x: Tensor, rope: Tensor, docs: Documents | None = None) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not cfg.n_heads: under tensor parallelism each rank holds only its heads' columns.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v) if docs is None else document_attention(q, k, v, docs)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer's FFN: dense SwiGLU, or a mixture of experts (shared experts are one SwiGLU of their total width)."""
    if not cfg.is_moe_layer(layer):
        return FeedForward(cfg.dim, cfg.ffn_dim)
    hidden, n_shared = cfg.expert_ffn_dim, cfg.moe.shared_experts
    shared = FeedForward(cfg.dim, n_shared * hidden) if n_shared else None
    return MoE(cfg.dim, hidden, cfg.moe, shared)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = feed_forward(cfg, layer)

    def forward(self, x: Tensor, rope: Tensor, docs: Documents | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, docs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab], or with targets the mean token loss; a pipeline stage
    maps hidden states or ids to either hidden states or logits."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Set by tensor parallelism, whose head splits the logits over the vocabulary: the loss then
        # needs them (loss_parallel) rather than the fused head-and-loss.
        self.vocab_parallel = False
        # The end-of-text id that ends each packed document (model.attention=document), set from the
        # dataset by whoever builds the model to train or evaluate it; None: each row is one document.
        self.eos_id: int | None = None
        # Non-persistent: derived from the config, so never checkpointed and rebuilt by init_weights.
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Block ``layer``; a family built on this decoder (DeepSeek) swaps in its own."""
        return TransformerBlock(cfg, layer)

    def rope_head_dim(self) -> int:
        """Channels RoPE rotates per head: all of them here."""
        return self.cfg.head_dim

    def _rope_table(self, device: torch.device | None = None) -> Tensor:
        return rope_table(
            self.rope_head_dim(), self.max_seq_len, self.cfg.rope_theta, device, self.cfg.rope_scaling
        )

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """targets: next tokens [B, T]; given them, the head returns the mean token loss (fp32) without
        holding the logits. The loss runs here, not after the call, because this is where FSDP holds
        the gathered output weight and DDP sees its use."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Documents are found once per micro-batch and shared by every block (pipeline stages, which
        # get hidden states rather than ids, are refused with document attention by the spec).
        docs = find_documents(tokens, self.eos_id) if self.cfg.attention == "document" else None
        per_document = docs is not None and self.cfg.rope_positions == "document"
        rope = self.rope[docs.positions] if per_document else self.rope
        for block in self.layers.values():
            h = block(h, rope, docs)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        if targets is None:
            return self.output(h)
        if self.vocab_parallel:
            return token_loss(self.output(h), targets)
        return linear_cross_entropy(h, self.output.weight, targets)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministically (re)initialize every parameter and buffer, e.g. after ``to_empty``.

        Works on plain and sharded (DTensor) parameters; a DTensor's local shard is drawn from a
        generator seeded by its global offset, so replicas agree and the result depends only on
        (seed, layout, device type: see ``DEVICE_DRAWN``).
        """
        self.rope.copy_(self._rope_table(self.rope.device))
        # Every other buffer is running state that starts at zero (an MoE router's balancing bias and load).
        for name, buffer in self.named_buffers():
            if name != "rope":
                buffer.zero_()
        for fqn, param in self.named_parameters():
            name = canonical_fqn(fqn)
            std = self._init_std(name)
            if std is None:
                param.fill_(1.0)
            elif std == 0:
                param.zero_()
            else:
                _fill_normal(param, std, seed, name)

    def _init_std(self, name: str) -> float | None:
        """Init rule by parameter name: None means ones (norm gains), 0 zeros (biases)."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0
        if name == "tok_embeddings.weight":
            # Untied: unit-variance embeddings (the first RMSNorm rescales anyway). Tied: the same matrix
            # also produces logits, so use the output projection's fan-in scale.
            return self.cfg.dim**-0.5 if self.cfg.tie_embeddings else 1.0
        if name == "output.weight":
            return self.cfg.dim**-0.5
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        return INIT_STD


def canonical_fqn(fqn: str) -> str:
    """The parameter's name in the unwrapped model (what checkpoints use)."""
    for prefix in WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def _fill_normal(param: Tensor, std: float, seed: int, name: str) -> None:
    """Fill param (or this rank's shard of it) with N(0, std²) values that depend only on seed and name."""
    target, offset = param, ()
    if isinstance(param, DTensor):
        target = param.to_local()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    key = f"{seed}/{name}/{tuple(offset)}".encode()
    device = target.device if target.device.type in DEVICE_DRAWN else torch.device("cpu")
    generator = torch.Generator(device).manual_seed(
        int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
    )
    values = torch.empty(target.shape, dtype=torch.float32, device=device).normal_(
        0.0, std, generator=generator
    )
    target.copy_(values)  # in the parameter's dtype

"""Context parallelism in the plan: ring attention's K/V traffic, how much attention hides, its buffers.

As ``trainer/parallel/context.py`` runs it, each block's attention on one chip is cp ring steps of
equal work (the load-balanced layout makes the first, causal step and every later half-block step the
same size). While a step computes, the chip's K,V chunk [b, T/cp, 2·kv_width/t] moves one hop:
forward cp−1 hops; backward cp−1 K,V hops plus cp hops of their fp32 gradients, the gradient hop of
step s hidden behind step s+1 (backward steps cost 2.5× forward, FlashAttention-2), the last one
exposed. A hop shows where it outlasts its step's attention; on CPU nothing hides (gloo's copies run
on the cores the compute saturates). Activation checkpointing reruns the forward ring.

Memory: every activation is 1/cp (``Geometry.microbatch_tokens``); the ring adds, for one block at a
time, the K,V chunk held and the one arriving, and in backward two fp32 copies of their gradients. The
plan assumes a fused (flash) kernel per ring step, which never materializes the scores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.plan.compute import BACKWARD_ATTENTION
from trainer.plan.layout import Geometry

if TYPE_CHECKING:  # comms imports this module for its traffic table
    from trainer.plan.comms import DimPlacement

FP32 = 4


def kv_chunk_bytes(geo: Geometry) -> float:
    """One hop of keys and values: this chip's T/cp tokens of its tp share of the kv heads, e bytes each."""
    kv_width = geo.model.n_kv_heads * geo.model.head_dim / geo.parallel.tp
    return 2 * geo.microbatch_tokens * kv_width * geo.compute_bytes


def grad_chunk_bytes(geo: Geometry) -> float:
    """One hop of the K,V gradients, accumulated in fp32."""
    return kv_chunk_bytes(geo) * FP32 / geo.compute_bytes


def forward_rings(geo: Geometry) -> int:
    """Forward rings per block and micro-batch: the forward, and its rerun under checkpointing."""
    return 1 + (geo.parallel.activation_checkpointing != "none")


def ring_bytes(geo: Geometry) -> float:
    """Bytes one chip sends per block and micro-batch."""
    n = geo.parallel.cp
    if n == 1:
        return 0.0
    return (forward_rings(geo) + 1) * (n - 1) * kv_chunk_bytes(geo) + n * grad_chunk_bytes(geo)


def hop_seconds(geo: Geometry, cp: DimPlacement) -> tuple[float, float]:
    """(K,V hop, gradient hop) over the cp dimension's link."""
    return (
        cp.latency_s + kv_chunk_bytes(geo) / cp.bandwidth,
        cp.latency_s + grad_chunk_bytes(geo) / cp.bandwidth,
    )


def ring_seconds(geo: Geometry, cp: DimPlacement) -> float:
    """Every hop of one block and micro-batch, before any overlap."""
    n = geo.parallel.cp
    if n == 1:
        return 0.0
    kv_hop, grad_hop = hop_seconds(geo, cp)
    return (forward_rings(geo) + 1) * (n - 1) * kv_hop + n * grad_hop


def ring_exposed_seconds(geo: Geometry, cp: DimPlacement, attention_forward: float, overlaps: bool) -> float:
    """The hops of one block and micro-batch that its attention does not hide.

    attention_forward: this chip's forward attention time of the block, all cp steps together.
    """
    n = geo.parallel.cp
    if n == 1:
        return 0.0
    kv_hop, grad_hop = hop_seconds(geo, cp)
    step = attention_forward / n if overlaps else 0.0
    forward = (n - 1) * max(0.0, kv_hop - step)
    backward = (n - 1) * max(0.0, kv_hop + grad_hop - BACKWARD_ATTENTION * step) + grad_hop
    return forward_rings(geo) * forward + backward


def ring_buffer_bytes(geo: Geometry) -> float:
    """Transient ring buffers of one block: two K,V chunks (held, arriving) and two fp32 gradient chunks."""
    if geo.parallel.cp == 1:
        return 0.0
    return 2 * kv_chunk_bytes(geo) + 2 * grad_chunk_bytes(geo)

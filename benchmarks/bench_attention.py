"""Document-masked vs causal attention (``model.attention``): CPU training tokens/s at the same shapes.

One fwd+bwd of a small Llama over packed rows (documents of ~SEQ/4 tokens on average, each ended by
EOS), with ``attention: causal`` and ``attention: document`` (per-document RoPE positions), from the
same weights on the same batch. On CPU, document attention runs SDPA with a dense [B, 1, T, T] mask
(FlexAttention has no CPU backward in torch 2.13; see trainer/models/documents.py), which computes
every tile where the causal kernel skips the upper triangle. Step time is the median of alternating
steps of the two in this process, so a noisy neighbour slows both; the mask's build time (once per
micro-batch, shared by every layer) is timed on its own.

    python -m benchmarks.bench_attention    # writes benchmarks/results/attention.json
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.common import Goal, Headline, main
from trainer.config import ModelConfig
from trainer.models.documents import find_documents
from trainer.models.llama.model import Transformer

DIMS = dict(preset="custom", n_layers=4, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=4096)
BATCH, SEQ, MEAN_DOCUMENT, EOS = 2, 1024, 256, 0
STEPS, WARMUP = 5, 1
HEADLINE = Headline(
    ratio="document_vs_causal",
    baseline="causal attention's training tokens/s at the same shapes (CPU, dense document mask)",
    # The dense mask at most doubles attention's work; attention is well under half of this step.
    goal=Goal("document_vs_causal", ">=", 0.5),
)


def build(attention: str) -> Transformer:
    cfg = ModelConfig(
        **DIMS,
        rope_theta=1e4,
        attention=attention,
        rope_positions="document" if attention == "document" else "sequence",
    )
    model = Transformer(cfg, max_seq_len=SEQ)
    model.init_weights(0)
    model.eos_id = EOS
    return model


def packed_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, DIMS["vocab_size"], (BATCH, SEQ + 1), generator=generator)
    ids[torch.rand(ids.shape, generator=generator) < 1 / MEAN_DOCUMENT] = EOS
    return ids


def step(model: Transformer, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    model(ids[:, :-1], ids[:, 1:]).backward()
    return time.perf_counter() - began


def run() -> dict[str, Any]:
    ids = packed_batch()
    models = {attention: build(attention) for attention in ("causal", "document")}
    times: dict[str, list[float]] = {side: [] for side in models}
    for i in range(WARMUP + STEPS):
        for side, model in models.items():
            seconds = step(model, ids)
            if i >= WARMUP:
                times[side].append(seconds)
    step_s = {side: statistics.median(t) for side, t in times.items()}
    tokens_per_s = {side: BATCH * SEQ / seconds for side, seconds in step_s.items()}
    mask_s = []
    for _ in range(STEPS):
        began = time.perf_counter()
        find_documents(ids[:, :-1], EOS)
        mask_s.append(time.perf_counter() - began)
    return {
        "shape": {"batch": BATCH, "seq_len": SEQ, **DIMS, "dtype": "float32"},
        "documents_per_row": ((ids[:, :-1] == EOS).sum(1) + 1).tolist(),
        "threads": torch.get_num_threads(),
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "mask_build_s": statistics.median(mask_s),
        "document_vs_causal": tokens_per_s["document"] / tokens_per_s["causal"],
    }


if __name__ == "__main__":
    main("attention", run)

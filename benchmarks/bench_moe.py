"""Mixture of experts on CPU: training tokens/s of an MoE model against a dense one of equal active size.

Both are 4-layer, d=256 decoders. The dense FFN is 1024 wide; the MoE layer routes each token to 2 of 8
experts 512 wide, so a token passes through the same 1024 hidden units (plus a 256×8 router) while the
MoE model holds ~4× the FFN parameters. One process, fp32, fwd+bwd+AdamW on random tokens, median of
``STEPS`` steps after a warm-up.

- ``ratio``: MoE over dense tokens/s (whole steps). Matmul FLOPs are equal, so the gap is routing
  overhead (the router, sorting slots by expert, gathering and scattering token rows, 8 smaller matmuls
  in place of one) and the optimizer, which updates all of the MoE's ~2.5× parameters every step.
- ``fwd_bwd_ratio``: the same for forward+backward alone (no optimizer).
- ``params``: total and active parameters of each (the planner's counts).

Run: ``python -m benchmarks.bench_moe`` (writes benchmarks/results/moe.json).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.common import Goal, Headline, main
from trainer.config import ModelConfig
from trainer.models.llama.model import Transformer
from trainer.parallel import token_loss
from trainer.plan.params import count_params

SEQ_LEN, BATCH, STEPS = 128, 4, 3
BASE = dict(preset="custom", n_layers=4, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=1024, vocab_size=4096)
MODELS = {
    "dense": ModelConfig(**BASE, rope_theta=1e4),
    "moe": ModelConfig(**BASE, rope_theta=1e4, moe=dict(n_experts=8, top_k=2, expert_ffn_dim=512)),
}
HEADLINE = Headline(
    ratio="ratio",
    baseline="dense tokens/s at equal active parameters (same FFN width per token)",
    goal=Goal("ratio", ">=", 0.5),
)


def measure(cfg: ModelConfig) -> dict[str, float]:
    model = Transformer(cfg, max_seq_len=SEQ_LEN)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(cfg.vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    steps, fwd_bwd = [], []
    for _ in range(STEPS + 1):  # the first is a warm-up
        start = time.perf_counter()
        token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        fwd_bwd.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - start)
    step_s = statistics.median(steps[1:])
    counts = count_params(cfg)
    return {
        "step_s": step_s,
        "fwd_bwd_s": statistics.median(fwd_bwd[1:]),
        "tokens_per_s": BATCH * SEQ_LEN / step_s,
        "params": counts.total,
        "active_params": counts.active,
    }


def run() -> dict[str, Any]:
    results: dict[str, Any] = {name: measure(cfg) for name, cfg in MODELS.items()}
    results["threads"] = torch.get_num_threads()
    results["ratio"] = results["moe"]["tokens_per_s"] / results["dense"]["tokens_per_s"]
    results["fwd_bwd_ratio"] = results["dense"]["fwd_bwd_s"] / results["moe"]["fwd_bwd_s"]
    return results


if __name__ == "__main__":
    main("moe", run)

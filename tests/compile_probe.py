"""One process that compiles the tiny model's blocks with Inductor and trains a step; prints JSON:
compile seconds and Inductor/AOTAutograd cache counters. ``python -m tests.compile_probe CACHE_DIR``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from trainer.config import ModelConfig
from trainer.models.llama.model import Transformer
from trainer.parallel.compile import apply_compile, compile_seconds, use_compile_cache

TINY = ModelConfig(
    preset="custom", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, rope_theta=1e4
)

if __name__ == "__main__":
    use_compile_cache(Path(sys.argv[1]))
    model = Transformer(TINY, max_seq_len=8)
    model.init_weights(0)
    apply_compile(model)
    tokens = torch.randint(TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    print(json.dumps({"compile_s": compile_seconds(), **counters["inductor"], **counters["aot_autograd"]}))

"""How long a checkpoint blocks training: async (thread) vs sync saves of the ``small`` model.

One process trains the ``small`` preset (AdamW, so ~3x the weights are saved) and checkpoints every
``INTERVAL`` steps (a cadence at which one write fits between checkpoints, as planned cadences do) through :class:`CheckpointManager` to a local directory; the stall is the manager's
``last_stall_s``: in async mode whatever of the background copy the next optimizer step had to wait
for, plus waiting for the previous save; in sync mode the whole write + hash + commit. Reported: mean stall per checkpoint for each mode and ``ratio`` = async / sync. Goal <= 0.1.

Beside it, the disk: a sync save's GB/s (the whole write, fsync and commit, with its hashes) over the raw
sequential write speed (fsync'd) of the same directory measured in the same run (``save_over_raw_write``;
the GPU benchmark's goal for it is >= 0.8).

Run: ``python -m benchmarks.bench_checkpoint`` (writes benchmarks/results/checkpoint.json).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import Goal, Headline, main
from trainer.checkpoint import CheckpointManager, ModelOptimizerState
from trainer.config import CheckpointConfig, ModelConfig
from trainer.models.llama.model import Transformer
from trainer.plan.disk import raw_disk_speed

SEQ_LEN = 128
SAVES = 3
INTERVAL = 2
HEADLINE = Headline(
    ratio="ratio", baseline="synchronous save (mean stall per checkpoint)", goal=Goal("ratio", "<=", 0.1)
)


def bench_mode(mode: str, directory: str) -> dict[str, float]:
    cfg = ModelConfig(preset="small")
    model = Transformer(cfg, SEQ_LEN)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN + 1))
    manager = CheckpointManager(
        directory, CheckpointConfig(mode=mode, keep_last=1), INTERVAL, "bench", 1, 0, {}
    )
    state = {"app": ModelOptimizerState([model], [optimizer])}
    stalls, step_s = [], []
    for step in range(1, SAVES * INTERVAL + 1):
        start = time.perf_counter()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
        manager.maybe_save(step, state, {"tokens": step * tokens[:, 1:].numel()})
        # Every step's: an optimizer step after a save may wait for its background copy.
        stalls.append(manager.last_stall_s)
    start = time.perf_counter()
    manager.close()
    checkpoint_bytes = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    return {
        "stall_s": sum(stalls) / SAVES,
        "close_s": time.perf_counter() - start,
        "train_step_s": statistics.mean(step_s),
        "checkpoint_bytes": checkpoint_bytes,
    }


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as sync_dir, tempfile.TemporaryDirectory() as async_dir:
        sync = bench_mode("sync", sync_dir)
        async_ = bench_mode("async", async_dir)
        raw = raw_disk_speed(Path(sync_dir), sync["checkpoint_bytes"])
    save_gbps = sync["checkpoint_bytes"] / sync["stall_s"] / 1e9
    return {
        "stall_async_s": async_["stall_s"],
        "stall_sync_s": sync["stall_s"],
        "ratio": async_["stall_s"] / sync["stall_s"],
        "async_close_s": async_["close_s"],
        "train_step_s": sync["train_step_s"],
        "checkpoint_bytes": sync["checkpoint_bytes"],
        "saves": SAVES,
        "save_gbps": save_gbps,
        "raw_write_gbps": raw["write_gbps"],
        "save_over_raw_write": save_gbps / raw["write_gbps"],
    }


if __name__ == "__main__":
    main("checkpoint", run)

"""What the in-memory tier costs and saves against storage, for the ``small`` model in one process.

One gloo process trains the ``small`` preset (AdamW) and, each step, snapshots its state into host
memory (:class:`HostMemoryTier`, a ``/dev/shm`` file; one process has no peer to send to) and saves a
synchronous storage checkpoint through :class:`CheckpointManager` (DCP + manifest) to a local
directory. Then fresh models and optimizers restore that state from each tier in turn, ``ROUNDS``
times. Reported: the mean stall per snapshot and per sync save, the median time to restore from each
(both include building the optimizer's state, which loading needs), and the headline
``restore_ratio`` = memory / storage (goal <= 0.5). Fault → training resumed end to end, with torchrun's restart, is in
the reliability report (``make faults``).

Run: ``python -m benchmarks.bench_recovery`` (writes benchmarks/results/recovery.json).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import Goal, Headline, main
from trainer.checkpoint import CheckpointManager, ModelOptimizerState
from trainer.checkpoint.ram_tier import HostMemoryTier
from trainer.config import CheckpointConfig, ModelConfig
from trainer.models.llama.model import Transformer

SEQ_LEN = 128
STEPS = 3
ROUNDS = 3  # restores per tier, alternating, so a busy box's swings fall on both (medians reported)
HEADLINE = Headline(
    ratio="restore_ratio",
    baseline="restore from a local storage checkpoint (DCP)",
    goal=Goal("restore_ratio", "<=", 0.5),
)


def fresh_state() -> dict[str, Any]:
    cfg = ModelConfig(preset="small")
    model = Transformer(cfg, SEQ_LEN)
    model.init_weights(0)
    return {"app": ModelOptimizerState([model], [torch.optim.AdamW(model.parameters(), lr=1e-3)])}


def train_and_save(
    state: dict[str, Any], memory: HostMemoryTier, storage: CheckpointManager
) -> dict[str, float]:
    (model,), (optimizer,) = state["app"].parts, state["app"].optimizers
    tokens = torch.randint(0, model.cfg.vocab_size, (2, SEQ_LEN + 1))
    snapshot_s, save_s = [], []
    for step in range(1, STEPS + 1):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        memory.maybe_snapshot(step, state)
        snapshot_s.append(memory.last_stall_s)
        storage.maybe_save(step, state, {"tokens": step * tokens[:, 1:].numel()})
        save_s.append(storage.last_stall_s)
    return {"snapshot_stall_s": statistics.mean(snapshot_s), "sync_save_stall_s": statistics.mean(save_s)}


def timed_restore(restore: Any) -> float:
    start = time.perf_counter()
    assert restore(fresh_state()) is not None
    return time.perf_counter() - start


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0, world_size=1)
        try:
            memory = HostMemoryTier(Path(shm), 1, rank=0, world_size=1, chips_per_node=1, timeout_s=60)
            storage = CheckpointManager(
                f"{directory}/checkpoints", CheckpointConfig(mode="sync", keep_last=1), 1, "bench", 1, 0, {}
            )
            stalls = train_and_save(fresh_state(), memory, storage)
            snapshot_bytes = sum(p.stat().st_size for p in Path(shm).glob("*.pt")) / 2  # two kept
            restores: dict[str, list[float]] = {"memory": [], "storage": []}
            for _ in range(ROUNDS):
                restores["memory"].append(
                    timed_restore(lambda state: memory.restore(state, not_older_than=0))
                )
                restores["storage"].append(timed_restore(storage.restore))
            memory_s, storage_s = (statistics.median(restores[tier]) for tier in ("memory", "storage"))
            storage.close()
        finally:
            dist.destroy_process_group()
    return {
        **stalls,
        "snapshot_bytes": snapshot_bytes,
        "memory_restore_s": memory_s,
        "storage_restore_s": storage_s,
        "snapshot_ratio": stalls["snapshot_stall_s"] / stalls["sync_save_stall_s"],
        "restore_ratio": memory_s / storage_s,
    }


if __name__ == "__main__":
    main("recovery", run)

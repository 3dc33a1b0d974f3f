"""How long a checkpoint blocks training, and how close saves and loads come to the disk's speed.

One process trains the ``small`` preset (AdamW, so ~3x the weights are saved) and checkpoints every
``INTERVAL`` steps (a cadence at which one write fits between checkpoints, as planned cadences do)
through :class:`CheckpointManager` to a local directory; the stall is the manager's ``last_stall_s``:
in async mode whatever of the background copy the next optimizer step had to wait for, plus waiting
for the previous save; in sync mode the whole write + commit. Reported: mean stall per checkpoint for
each mode and ``ratio`` = async / sync. Goal <= 0.1.

Beside it, the disk, measured in the same run on the same directory (``trainer.plan.disk``: one
large sequential write, fsync'd, then read back with its pages dropped from the page cache):

* ``save_over_raw_write``: a sync save's GB/s (the whole write, fsync and commit) over the raw write
  (the goal of issue #28 is >= 0.8);
* ``load_over_raw_read``: a restore of the last sync save, its files' pages dropped first, over the
  raw read;
* ``sync_times`` / ``async_times``: where a save's time goes, mean per save (the manager's
  ``SaveTimes``: staging, write, commit, retention).

Run: ``python -m benchmarks.bench_checkpoint`` (writes benchmarks/results/checkpoint.json).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import Goal, Headline, main
from trainer.checkpoint import CheckpointManager, ModelOptimizerState
from trainer.checkpoint.manager import SaveTimes
from trainer.config import CheckpointConfig, ModelConfig
from trainer.models.llama.model import Transformer
from trainer.plan.disk import drop_cached, raw_disk_speed

SEQ_LEN = 128
SAVES = 3
INTERVAL = 2
HEADLINE = Headline(
    ratio="ratio", baseline="synchronous save (mean stall per checkpoint)", goal=Goal("ratio", "<=", 0.1)
)


def bench_mode(mode: str, directory: str) -> tuple[dict[str, Any], dict[str, ModelOptimizerState]]:
    """Train and checkpoint in ``mode``; the figures, and the state (to load the last save into)."""
    cfg = ModelConfig(preset="small")
    model = Transformer(cfg, SEQ_LEN)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN + 1))
    manager = CheckpointManager(
        directory, CheckpointConfig(mode=mode, keep_last=1), INTERVAL, "bench", 1, 0, {}
    )
    state = {"app": ModelOptimizerState([model], [optimizer])}
    stalls, step_s, times = [], [], []
    for step in range(1, SAVES * INTERVAL + 1):
        start = time.perf_counter()
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_s.append(time.perf_counter() - start)
        manager.maybe_save(step, state, {"tokens": step * tokens[:, 1:].numel()})
        # Every step's: an optimizer step after a save may wait for its background copy.
        stalls.append(manager.last_stall_s)
        times.append(manager.last_save_times)
    start = time.perf_counter()
    manager.close()
    close_s = time.perf_counter() - start
    times.append(manager.last_save_times)
    checkpoint_bytes = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    figures = {
        "stall_s": sum(stalls) / SAVES,
        "close_s": close_s,
        "train_step_s": statistics.mean(step_s),
        "checkpoint_bytes": checkpoint_bytes,
        "times": mean_times(times),
    }
    return figures, state


def mean_times(seen: list[SaveTimes | None]) -> dict[str, float]:
    """The mean of each phase over the distinct saves in ``seen`` (a save's times appear once it commits)."""
    saves = list({id(t): t for t in seen if t is not None}.values())
    return {
        field.name: statistics.mean(getattr(t, field.name) for t in saves)
        for field in dataclasses.fields(SaveTimes)
    } | {"total_s": statistics.mean(t.total_s for t in saves), "saves": len(saves)}


def load_seconds(directory: str, state: dict[str, ModelOptimizerState]) -> float:
    """Restore the newest checkpoint under ``directory`` into ``state``, read from the disk."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            drop_cached(path)
    manager = CheckpointManager(directory, CheckpointConfig(mode="sync", keep_last=1), 1, "bench", 1, 0, {})
    start = time.perf_counter()
    manager.restore(state)
    seconds = time.perf_counter() - start
    manager.close()
    return seconds


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as sync_dir, tempfile.TemporaryDirectory() as async_dir:
        sync, state = bench_mode("sync", sync_dir)
        async_, _ = bench_mode("async", async_dir)
        load_s = load_seconds(sync_dir, state)
        raw = raw_disk_speed(Path(sync_dir), sync["checkpoint_bytes"])
    save_gbps = sync["checkpoint_bytes"] / sync["stall_s"] / 1e9
    load_gbps = sync["checkpoint_bytes"] / load_s / 1e9
    return {
        "stall_async_s": async_["stall_s"],
        "stall_sync_s": sync["stall_s"],
        "ratio": async_["stall_s"] / sync["stall_s"],
        "async_close_s": async_["close_s"],
        "train_step_s": sync["train_step_s"],
        "checkpoint_bytes": sync["checkpoint_bytes"],
        "saves": SAVES,
        "sync_times": sync["times"],
        "async_times": async_["times"],
        "save_gbps": save_gbps,
        "raw_write_gbps": raw["write_gbps"],
        "save_over_raw_write": save_gbps / raw["write_gbps"],
        "load_s": load_s,
        "load_gbps": load_gbps,
        "raw_read_gbps": raw["read_gbps"],
        "load_over_raw_read": load_gbps / raw["read_gbps"],
    }


if __name__ == "__main__":
    main("checkpoint", run)

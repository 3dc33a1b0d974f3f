"""The few-step spec the orchestration tests run: the real pipeline, as small as it gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deployments.spec import TrainingSpec
from trainer.rundir import RunDir

# The trainer's own tests use a smaller model than the tiny preset: milliseconds a step, 4 ranks on 2 cores.
MICRO_MODEL: dict[str, Any] = {
    "preset": "custom",
    "n_layers": 2,
    "dim": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "vocab_size": 256,
    "rope_theta": 1e4,
}


def tiny_spec_dict(
    root: Path, name: str, steps: int = 6, interval: int = 3, **overrides: Any
) -> dict[str, Any]:
    """2 CPU processes (FSDP2 over gloo), a generated corpus, checkpoints every ``interval`` steps."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {"preset": "tiny"},
        "data": {"source": "generated", "output_url": str(root / "data"), "max_documents": 200},
        "train": {"steps": steps, "seq_len": 32, "global_batch_size": 4, "micro_batch_size": 2},
        "parallel": {"dp_shard": 2},
        "cluster": {"accelerator": "cpu", "chip": "cpu", "nodes": 1, "chips_per_node": 2},
        "checkpoint": {"interval": interval, "keep_last": 5, "mode": "sync"},
        "optimizer": {"warmup_steps": 1},
        "eval": {"batches": 2, "sample_tokens": 4, "poll_interval_s": 0.5},
        "faults": {"retry_delay_s": 0},
    }
    for section, values in overrides.items():
        spec[section] = {**spec[section], **values} if isinstance(values, dict) else values
    return spec


def tiny_spec(root: Path, name: str, **kwargs: Any) -> TrainingSpec:
    return TrainingSpec.model_validate(tiny_spec_dict(root, name, **kwargs))


def run_of(runs_dir: Path, name: str) -> RunDir | None:
    """The run of spec ``name`` under ``runs_dir``, once a flow has opened it (each test has its own
    runs root, so there is at most one per name unless the test starts several)."""
    runs = sorted(p for p in runs_dir.glob(f"{name}-*") if (p / "run.json").exists())
    assert len(runs) <= 1, f"several runs of {name}: {runs}"
    return RunDir(runs[0]) if runs else None

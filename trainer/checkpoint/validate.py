"""Prove a committed checkpoint is intact and loadable, then mark its record validated or corrupt.

Checks, cheapest first: a committed record, every file's sha256 and size, DCP metadata, then a
separate process group of a *different* world size than the save loads every tensor, resharded from
the metadata alone (no model code), and checks they are finite. A corrupt checkpoint is skipped by
``CheckpointManager.latest``, which falls back to the previous good one.

The load is streamed: tensors are read in groups of at most ``budget_bytes`` (one ``dcp.load`` of a
partial state dict per group, built from the ``.metadata`` alone) and dropped once checked, so a
loading process holds about the budget plus the saved chunk being read, never the whole model
(~96 GB for an 8B model with its optimizer state). That is what lets validation run in a small
orchestrator pod for any model size.

The loading half runs as ``python -m trainer.checkpoint.validate STEP_URL [--budget-bytes N]`` (under
torchrun when the world size is > 1) and prints one JSON line: {"ok": bool, "reason": str, "tensors": int}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from trainer import storage
from trainer.checkpoint import store
from trainer.checkpoint.commit import CommitRecord, check_model, digest_files, read_commit, write_commit
from trainer.checkpoint.errors import CheckpointError, CheckpointStoreError
from trainer.config import JobConfig
from trainer.rank.local_tensor import local_tensor
from trainer.runtime.launch import through_shared_fork_server, torchrun_command
from trainer.units import MiB

LOAD_TIMEOUT_S = 1800.0
# Tensor bytes one loading process holds at a time: far below the 4 GiB orchestrator pod, large enough
# that a group's read is a few big sequential reads rather than one request per small tensor.
BUDGET_BYTES = 256 * MiB


@dataclass
class ValidationResult:
    step_url: str
    step: int
    status: Literal["validated", "corrupt"]
    reason: str
    saved_world_size: int
    loaded_world_size: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "validated"


def validate_checkpoint(
    step_url: str, job: JobConfig, world_size: int = 1, budget_bytes: int = BUDGET_BYTES
) -> ValidationResult:
    """Validate one checkpoint directory and record the verdict in its record.

    ``world_size`` is the loading world size; if it equals the saved one, 1 (or 2 for a single-process
    save) is used instead, so resharding is always exercised. ``budget_bytes`` bounds the tensor bytes
    each loading process holds at once.
    """
    start = time.perf_counter()
    step_url = step_url.rstrip("/")
    record = read_commit(step_url)
    if record is None:
        what = (
            "has no tessera.json commit record (a partial write)" if _exists(step_url) else "does not exist"
        )
        raise CheckpointStoreError(f"checkpoint {step_url} {what}; validate a committed checkpoint")
    check_model(record, job.model_fingerprint())
    if world_size == record.world_size:
        world_size = 2 if record.world_size == 1 else 1
    reason = _integrity_problem(record) or _load_problem(step_url, world_size, budget_bytes)
    record.status, record.reason = ("corrupt", reason) if reason else ("validated", "")
    if _exists(step_url):  # retention may have deleted it meanwhile: don't resurrect a lone record
        write_commit(step_url, record)
    return ValidationResult(
        step_url,
        record.step,
        record.status,
        reason,
        record.world_size,
        world_size,
        time.perf_counter() - start,
    )


def _exists(step_url: str) -> bool:
    with store.store_errors("stat", step_url):
        return storage.exists(step_url)


def _integrity_problem(record: CommitRecord) -> str:
    """'' if the files are exactly those the record lists, byte for byte; else what differs."""
    if record.status not in ("committed", "validated"):
        return f"commit record status is {record.status!r} ({record.reason})"
    actual = digest_files(record.url)
    missing = sorted(set(record.files) - set(actual))
    if missing:
        return f"files missing: {', '.join(missing)}"
    changed = sorted(name for name, digest in record.files.items() if actual[name] != digest)
    if changed:
        return f"sha256 mismatch: {', '.join(changed)}"
    try:
        store.storage_reader(record.url).read_metadata()
    except Exception as exc:
        return f"DCP metadata unreadable: {exc}"
    return ""


def _load_problem(step_url: str, world_size: int, budget_bytes: int) -> str:
    """Load every tensor in a fresh process group of ``world_size``; '' if all load and are finite."""
    module = ["-m", "trainer.checkpoint.validate", step_url, f"--budget-bytes={budget_bytes}"]
    # The job file and run directory are arguments of the default entry only: this one needs neither.
    command = (
        [sys.executable, *module]
        if world_size == 1
        else torchrun_command(Path(), Path(), world_size, entry=module)
    )
    # One intra-op thread, as torchrun gives each of several workers: the loader only reads and checks
    # tensors, and with it the host's fork server (whose ranks have the same) forks the loaders warm
    # instead of refusing them for another OMP_NUM_THREADS (a cold loader: ~5 s of imports).
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    (command,), env = through_shared_fork_server([command], env)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"validation loader for {step_url} ran over {LOAD_TIMEOUT_S:.0f} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(f"validation loader for {step_url} failed (exit {proc.returncode}): {tail}")
    verdict = json.loads(lines[-1])
    return "" if verdict["ok"] else verdict["reason"]


def saved_bytes(meta: TensorStorageMetadata | BytesStorageMetadata) -> int:
    """Bytes of one saved tensor; 0 for a pickled value (RNG and loader state: small)."""
    if not isinstance(meta, TensorStorageMetadata):
        return 0
    return meta.size.numel() * meta.properties.dtype.itemsize


def tensor_groups(metadata: Metadata, budget_bytes: int) -> list[list[str]]:
    """The checkpoint's keys in groups whose tensors total at most ``budget_bytes``; a tensor larger
    than the budget is a group of its own."""
    groups: list[list[str]] = [[]]
    held = 0
    for key, meta in metadata.state_dict_metadata.items():
        size = saved_bytes(meta)
        if groups[-1] and held + size > budget_bytes:
            groups.append([])
            held = 0
        groups[-1].append(key)
        held += size
    return groups


def _empty_like_saved(metadata: Metadata, keys: list[str], mesh: DeviceMesh | None) -> dict[str, Any]:
    """A flat state dict of ``keys`` shaped like the checkpoint: tensors sharded on dim 0 over ``mesh``
    (a layout the save never had), placeholders for pickled objects."""
    state: dict[str, Any] = {}
    for key in keys:
        meta = metadata.state_dict_metadata[key]
        if not isinstance(meta, TensorStorageMetadata):
            state[key] = None
        elif mesh is None:
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            placement = Shard(0) if len(meta.size) else Replicate()
            state[key] = dtensor.empty(
                meta.size, dtype=meta.properties.dtype, device_mesh=mesh, placements=[placement]
            )
    return state


def _nonfinite(state: dict[str, Any]) -> list[str]:
    """Keys of floating tensors with a NaN/inf anywhere (every rank checks its shard)."""
    keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
    bad = torch.tensor(
        [int(not torch.isfinite(local_tensor(state[k])).all()) for k in keys],
        dtype=torch.int64,
    )
    if dist.is_initialized():
        dist.all_reduce(bad)
    return [k for k, flag in zip(keys, bad.tolist(), strict=True) if flag]


def load_and_check(step_url: str, budget_bytes: int = BUDGET_BYTES) -> dict[str, Any]:
    """Load every tensor of the checkpoint, one group of at most ``budget_bytes`` at a time, and check
    each is finite; the verdict as :func:`main` prints it."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
    reader = store.storage_reader(step_url)
    metadata = reader.read_metadata()
    tensors, bad = 0, []
    for keys in tensor_groups(metadata, budget_bytes):
        state = _empty_like_saved(metadata, keys, mesh)
        try:
            store.load(state, step_url, no_dist=mesh is None, reader=reader)
        except Exception as exc:
            return {"ok": False, "reason": f"load into world size {world_size} failed: {exc}".splitlines()[0]}
        bad += _nonfinite(state)
        tensors += sum(isinstance(v, torch.Tensor) for v in state.values())
        del state  # before the next group is allocated
    if bad:
        return {"ok": False, "reason": f"non-finite values in {len(bad)} tensors, e.g. {sorted(bad)[0]}"}
    return {"ok": True, "reason": "", "tensors": tensors}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint.validate")
    parser.add_argument("step_url")
    parser.add_argument("--budget-bytes", type=int, default=BUDGET_BYTES)
    args = parser.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    verdict = load_and_check(args.step_url, args.budget_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(verdict), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

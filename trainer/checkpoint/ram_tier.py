"""The host-RAM checkpoint tier: every rank's latest state in host memory (tmpfs), and a copy on a peer node.

Every ``memory_interval_steps`` each rank writes its own shard of the training state (model and
optimizer shards, RNG, loader position, step) to a file in a tmpfs directory (``/dev/shm``), then a
background thread sends the bytes to its ring peer, the same local rank on the next node, which keeps
them as a file in its own tmpfs. A restart restores from the newest step every rank can get: from its
own host's file when its host survived, from the peer's copy when it did not, from storage otherwise.

Why tmpfs files and no keeper process: tmpfs pages belong to the host, not to a process, so they
outlive ``kill -9`` of the worker and torchrun's restart of the whole worker group with no process to
keep alive, and a restarted rank reads them back at memory speed. They go when the host does (the
peer's copy covers that), when the run finishes (``discard``), or with the pod's RAM-backed
``/dev/shm`` volume on Kubernetes. A file appears under its final name only once complete (written,
then renamed), so a rank killed mid-write leaves its previous snapshot, never a torn one.

Snapshots hold each rank's local shards, so they restore only into the same world size and layout,
which is part of the directory's name: after a resize, the directory is another and storage is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.utils.serialization
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.config import JobConfig

log = logging.getLogger(__name__)

# Two per rank and per tier: a rank killed while writing step s still has its previous snapshot, and
# no rank is ever more than one snapshot ahead of another (the step's collectives keep them together),
# so some step is always present on every rank.
SNAPSHOTS_KEPT = 2
_NAME = re.compile(r"rank-(\d+)\.(own|peer)\.step-(\d+)\.pt$")

Tier = Literal["own", "peer"]


def memory_directory(job: JobConfig) -> Path:
    """The run's directory under ``checkpoint.memory_dir``: named by the checkpoint location, the model
    and the layout, so only a restart of the same run with the same shards finds it."""
    identity = [
        job.checkpoint.url,
        job.model_fingerprint(),
        job.parallel.model_dump_json(),
        job.hardware.nodes,
    ]
    digest = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    return Path(job.checkpoint.memory_dir) / f"tessera-{digest}"


@dataclass(frozen=True)
class Inventory:
    """What one rank's host holds: its own snapshots and the copies it keeps for its ring predecessor,
    as step → size in bytes (the size tells a receiver what to expect)."""

    own: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Restored:
    step: int
    tier: Tier
    detail: str  # for the log: which host's memory


def newest_common_step(inventories: list[Inventory], holder: Callable[[int], int | None]) -> int | None:
    """The newest step every rank can restore: from its own snapshot or from the copy its ring peer
    (``holder(rank)``; None without one) holds. None if there is no such step."""
    candidates = set().union(*(inv.own.keys() | inv.held.keys() for inv in inventories))
    for step in sorted(candidates, reverse=True):
        if all(_tier_of(rank, step, inventories, holder) is not None for rank in range(len(inventories))):
            return step
    return None


def _tier_of(
    rank: int, step: int, inventories: list[Inventory], holder: Callable[[int], int | None]
) -> Tier | None:
    if step in inventories[rank].own:
        return "own"
    peer = holder(rank)
    return "peer" if peer is not None and step in inventories[peer].held else None


class HostMemoryTier:
    """One per training process; ``restore`` is collective, ``maybe_snapshot`` must be called by every
    rank at every step (the peer sends pair up ranks in step order)."""

    def __init__(
        self,
        directory: Path,
        interval_steps: int,
        rank: int,
        world_size: int,
        chips_per_node: int,
        timeout_s: float,
    ) -> None:
        self.directory = directory
        self.interval_steps = interval_steps
        self.rank, self.world_size = rank, world_size
        # Ring over nodes: rank r's copy lives with the same local rank on the next node.
        self._stride = chips_per_node if world_size > chips_per_node else None
        self.next, self.previous = self.holder(rank), self.holder(rank, -1)
        self.last_stall_s = 0.0  # seconds the last maybe_snapshot blocked training
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for partial in directory.glob("*.tmp"):  # writes killed midway (this host's ranks are all starting)
            partial.unlink(missing_ok=True)
        # The peer sends run in a background thread: their own group keeps them apart from the step's.
        self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._sending: Future[None] | None = None
        if self.next is None and rank == 0:
            log.warning("in-memory tier: one node, so no peer copies; a lost host falls back to storage")

    def holder(self, rank: int, direction: int = 1) -> int | None:
        """The rank on the next node (``direction=-1``: previous) that holds ``rank``'s copy; None on one node."""
        return None if self._stride is None else (rank + direction * self._stride) % self.world_size

    # ------------------------------------------------------------------------------------- snapshots

    def maybe_snapshot(self, step: int, state: dict[str, Stateful]) -> None:
        """Every ``interval_steps``: write this rank's state to host memory, then send it to the peer."""
        if step % self.interval_steps:
            self.last_stall_s = 0.0
            return
        started = time.perf_counter()
        self._wait_for_send()  # one send in flight: the previous snapshot's
        path = self._path(self.rank, "own", step)
        _write_atomically(
            path, lambda temporary: _save_without_crc(_snapshot(step, self.rank, state), temporary)
        )
        self._prune(self.rank, "own", keep_after=None)
        if self.next is not None:
            self._sending = Future()
            threading.Thread(
                target=self._send_to_peer,
                args=(step, path, self._sending),
                name="memory-peer-send",
                daemon=True,
            ).start()
        self.last_stall_s = time.perf_counter() - started

    def _send_to_peer(self, step: int, path: Path, done: Future[None]) -> None:
        """Swap copies around the ring: ours to ``next``, ``previous``'s into our tmpfs."""
        try:
            assert self.next is not None and self.previous is not None
            payload = _read_tensor(path)
            received = self._swap(payload, step)
            _write_atomically(self._path(self.previous, "peer", step), received.numpy().tofile)
            self._prune(self.previous, "peer", keep_after=None)
            done.set_result(None)
        except Exception as exc:  # reported by the training thread at the next snapshot
            done.set_exception(exc)

    def _swap(self, payload: torch.Tensor, step: int) -> torch.Tensor:
        assert self.next is not None and self.previous is not None
        header = torch.tensor([step, payload.numel()], dtype=torch.int64)
        incoming = torch.empty(2, dtype=torch.int64)
        _exchange(header, self.next, incoming, self.previous, self._pg)
        if int(incoming[0]) != step:
            raise RuntimeError(
                f"in-memory tier: rank {self.previous} sent step {int(incoming[0])}, not {step}"
            )
        received = torch.empty(int(incoming[1]), dtype=torch.uint8)
        _exchange(payload, self.next, received, self.previous, self._pg)
        return received

    def _wait_for_send(self) -> None:
        """A failed send costs only the peer's copy being older; a dead peer fails the step anyway."""
        if self._sending is not None:
            sending, self._sending = self._sending, None
            if (error := sending.exception()) is not None:
                log.warning("in-memory tier: sending the snapshot to rank %s failed: %s", self.next, error)

    # ----------------------------------------------------------------------------------------- restore

    def inventory(self) -> Inventory:
        own, held = {}, {}
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match is None:
                continue
            rank, tier, step = int(match[1]), match[2], int(match[3])
            if tier == "own" and rank == self.rank:
                own[step] = path.stat().st_size
            elif tier == "peer" and rank == self.previous:
                held[step] = path.stat().st_size
        return Inventory(own, held)

    def restore(self, state: dict[str, Stateful], not_older_than: int) -> Restored | None:
        """Load the newest step (at least ``not_older_than``, what storage has) that every rank can get
        from host memory; None if there is none. Call ``discard_after`` with the step resumed from,
        whichever tier it came from."""
        inventories: list[Inventory] = [Inventory()] * self.world_size
        dist.all_gather_object(inventories, self.inventory(), group=self._pg)
        step = newest_common_step(inventories, self.holder)
        if step is None or step < not_older_than:
            return None
        tier = _tier_of(self.rank, step, inventories, self.holder)
        assert tier is not None
        own = self._path(self.rank, "own", step)
        received = self._serve_peers(step, inventories)
        if received is not None:  # the peer's copy becomes this host's own snapshot again
            _write_atomically(own, received.numpy().tofile)
        # Mapped, not read: the tensors are views of the tmpfs pages until loading copies them in.
        _load(torch.load(own, mmap=True, weights_only=True), step, self.rank, state)
        detail = "own host memory" if tier == "own" else f"peer host memory (rank {self.next}'s host)"
        log.info("restored step %d from %s", step, detail)
        return Restored(step, tier, detail)

    def _serve_peers(self, step: int, inventories: list[Inventory]) -> torch.Tensor | None:
        """Send the copy we hold to our predecessor if it lost its own; receive ours if we lost ours."""
        sends: list[dist.P2POp] = []
        mine = None
        if self.previous is not None and step not in inventories[self.previous].own:
            sends.append(
                dist.P2POp(
                    dist.isend, _read_tensor(self._path(self.previous, "peer", step)), self.previous, self._pg
                )
            )
        if step not in inventories[self.rank].own:
            assert self.next is not None
            mine = torch.empty(inventories[self.next].held[step], dtype=torch.uint8)
            sends.append(dist.P2POp(dist.irecv, mine, self.next, self._pg))
        for request in dist.batch_isend_irecv(sends) if sends else []:
            request.wait()
        return mine

    def discard_after(self, step: int) -> None:
        """Drop this host's snapshots newer than ``step``: they belong to a timeline that was abandoned."""
        self._prune(self.rank, "own", keep_after=step)
        if self.previous is not None:
            self._prune(self.previous, "peer", keep_after=step)

    def discard(self) -> None:
        """The run is done: free this rank's host memory (its own snapshots and the copies it held)."""
        self._wait_for_send()
        self.discard_after(-1)
        with contextlib.suppress(OSError):  # the last rank to leave removes the directory
            self.directory.rmdir()

    # ----------------------------------------------------------------------------------------- files

    def _path(self, rank: int, tier: Tier, step: int) -> Path:
        return self.directory / f"rank-{rank:05d}.{tier}.step-{step:09d}.pt"

    def _prune(self, rank: int, tier: Tier, keep_after: int | None) -> None:
        """Keep the newest SNAPSHOTS_KEPT, or with ``keep_after``, none newer than that step."""
        paths = sorted(self.directory.glob(f"rank-{rank:05d}.{tier}.step-*.pt"))
        doomed = (
            paths[:-SNAPSHOTS_KEPT]
            if keep_after is None
            else [p for p in paths if int(_NAME.match(p.name)[3]) > keep_after]  # type: ignore[index]
        )
        for path in doomed:
            path.unlink(missing_ok=True)


def _snapshot(step: int, rank: int, state: dict[str, Stateful]) -> dict[str, Any]:
    """This rank's part of ``state``: DTensors become their local shards (all this rank must keep)."""
    return {
        "step": step,
        "rank": rank,
        "state": {key: _local(value.state_dict()) for key, value in state.items()},
    }


def _local(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        return tree.to_local().detach().cpu()
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {key: _local(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_local(value) for value in tree)
    return tree


def _like(saved: Any, template: Any) -> Any:
    """``saved`` local shards placed as ``template``'s (DTensors on the same mesh, same device)."""
    if isinstance(template, DTensor):
        local = saved.to(template.to_local().device)
        return DTensor.from_local(
            local,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(template, torch.Tensor):
        return saved.to(template.device)
    if isinstance(template, dict):
        return {key: _like(saved[key], value) for key, value in template.items()}
    return saved


def _load(saved: dict[str, Any], step: int, rank: int, state: dict[str, Stateful]) -> None:
    if (saved["step"], saved["rank"]) != (step, rank):
        raise RuntimeError(
            f"in-memory snapshot holds rank {saved['rank']} step {saved['step']}, expected rank {rank} step {step}"
        )
    for key, value in state.items():
        value.load_state_dict(_like(saved["state"][key], value.state_dict()))


def _exchange(
    send: torch.Tensor, to: int, receive: torch.Tensor, source: int, group: dist.ProcessGroup
) -> None:
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, receive, source, group)]
    )
    for request in requests:
        request.wait()


def _read_tensor(path: Path) -> torch.Tensor:
    """A file's bytes as a uint8 tensor, read straight into it (one copy)."""
    data = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with path.open("rb") as file:
        file.readinto(data.numpy())  # type: ignore[attr-defined]
    return data


def _save_without_crc(obj: Any, path: Path) -> None:
    """``torch.save`` without zip CRC32s: they cost over half the save here (a 200 MB tensor to tmpfs,
    1.37 s → 0.60 s), and host memory and the peer send (TCP) need no second checksum."""
    save_config = torch.utils.serialization.config.save
    crc, save_config.compute_crc32 = save_config.compute_crc32, False
    try:
        torch.save(obj, path)
    finally:
        save_config.compute_crc32 = crc


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` to a temporary name, then rename: the final name only ever holds a whole file."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    os.replace(temporary, path)

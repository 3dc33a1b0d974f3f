"""Replica-level fault tolerance (``faults.replica_fault_tolerance``): a lost replica group stops no other.

Each of the ``parallel.dp_replicate`` replica groups is its own torchrun job, with its own restarts; the
replicate dimension is not in any device mesh. The gradient average across replicas goes through
torchft instead: a Lighthouse (hosted by the launcher) forms a quorum of the replicas alive at each
step, a per-replica ``Manager`` reconfigures a gloo group over them, and the optimizer steps only when
the step committed. A replica killed mid-run costs the others one quorum (the Lighthouse notices its
missing heartbeats, :data:`HEARTBEAT_TIMEOUT_S` at most) and they continue on the replicas left; the
restarted one joins the next quorum and first heals from a live peer: its model, optimizer and loader
position, sent over HTTP, so every replica again holds the same weights, bit for bit.

A replica group may itself be sharded (HSDP with the replicate dimension fault tolerant; TP, PP, EP). Then
torchft runs one Manager per rank (group rank 0 hosts the replica's Manager server,
which votes for all of them): rank i of every replica averages its own gradient shards with rank i of
the others, and heals from rank i of a live peer, since replicas share a layout and so their shards.

What it changes: a step that ran on fewer replicas averaged fewer gradients (the lost replicas' rows of
that global batch are never trained), so the loss curve after a loss is not an uninterrupted run's.
Up to the first loss it is. Supported inside a replica group: FSDP, TP, PP and EP, in any precision
(each rank's gradients and state are its own shards, the same on rank i of every replica); CP is
refused by ``trainer.replicas.replica_ft_errors``.

Only ``trainer.train`` imports this module, and only with the switch on; torchft itself is imported
inside the functions that use it. The groups' commands and the Lighthouse are in
``trainer.runtime.replica_groups``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from trainer.config import JobConfig
from trainer.failures import UserError
from trainer.rank.local_tensor import local_tensor
from trainer.rank.step_hooks import step_statistics
from trainer.replicas import LIGHTHOUSE_ENV, REPLICA_ENV, replica_job

if TYPE_CHECKING:
    from torchft import Manager

JOIN_POLL_S = 0.2


class ReplicaOutOfStep(ConnectionError):
    """This replica fell behind the others while running (it missed a step they committed): a
    ConnectionError, so the process exits as a retryable infrastructure failure and its restart heals."""


class ReplicaGroup:
    """This process's replica group, averaging gradients with the other live groups through torchft."""

    def __init__(self, job: JobConfig, env: Mapping[str, str] = os.environ) -> None:
        self.replicas = job.parallel.dp_replicate
        replica, self.lighthouse = env.get(REPLICA_ENV, ""), env.get(LIGHTHOUSE_ENV, "")
        if not replica.isdigit() or int(replica) >= self.replicas or not self.lighthouse:
            raise UserError(
                f"faults.replica_fault_tolerance: each replica group's workers need {REPLICA_ENV} (0 to "
                f"{self.replicas - 1}) and {LIGHTHOUSE_ENV} (now {replica!r}, {self.lighthouse!r}); launch each "
                "group with its command from trainer.runtime.replica_groups.replica_groups"
            )
        self.replica = int(replica)
        self.job = replica_job(job, self.replica)
        self.timeout = timedelta(seconds=job.faults.collective_timeout_s)
        self.manager: Manager | None = None
        self.quorum_open = False  # join() ran the quorum of the step that follows it
        self.loader: Stateful | None = None
        # The loader's position after the last committed step. A peer heals to that step, while our own
        # loader has already handed out the batch of the step in flight.
        self.position: dict[str, Any] = {}

    def data_shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """(rank, size) among all replicas' data-parallel ranks: which rows of each global batch are ours."""
        return self.replica * dp_size + dp_rank, self.replicas * dp_size

    def join(self, step: int, model: Stateful, loader: Stateful, device: torch.device) -> int:
        """Join the replicas at ``step`` (restored from this replica's own checkpoint, 0 for a fresh
        start); returns the step to continue after: a live peer's, when it was ahead and we healed from it.

        The heal state is ``model`` (model and optimizer state) and the loader's position; the step is
        torchft's own. A fresh run waits up to the collective timeout for every replica group, so that
        all of them train from the first step; a replica that comes later heals in.
        """
        self.loader, self.position = loader, loader.state_dict()

        def save() -> dict[str, Any]:
            return {"model": local_shards(model.state_dict()), "loader": self.position}

        def load(saved: dict[str, Any]) -> None:
            model.load_state_dict(as_shards_of(saved["model"], model.state_dict()))
            loader.load_state_dict(saved["loader"])
            self.position = saved["loader"]

        # Group rank 0 publishes its Manager server's address in the replica's store, where the others
        # look it up: after a restart the store still holds the last attempt's, so they wait for this one.
        if dist.get_rank() == 0:
            self.manager = self._manager(save, load)
        dist.barrier()
        if dist.get_rank() != 0:
            self.manager = self._manager(save, load)
        assert self.manager is not None
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.replicas})
        deadline = time.monotonic() + self.timeout.total_seconds()
        self.manager.start_quorum()
        # Every rank of the group must call start_quorum equally often (the group's Manager server waits
        # for all of them), so they agree on each wait: a rank past its own deadline while another is
        # not would leave that one waiting in a quorum its peers never join.
        while step == 0 and _any_rank(
            self.manager.num_participants() < self.replicas and time.monotonic() < deadline, device
        ):
            time.sleep(JOIN_POLL_S)
            self.manager.start_quorum()
        self.quorum_open = True
        return self.manager.current_step()

    def _manager(self, save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> Manager:
        """This rank's torchft Manager: its replicate-dimension gloo group, quorum and heal."""
        from torchft import Manager, ProcessGroupGloo

        return Manager(
            pg=ProcessGroupGloo(timeout=self.timeout),
            load_state_dict=load,
            state_dict=save,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the forward pass, never during it
            timeout=self.timeout,
            quorum_timeout=self.timeout,
            connect_timeout=self.timeout,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=os.environ["MASTER_ADDR"],  # torchrun's agent store: this replica group's own
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=self.lighthouse,
            replica_id=f"tessera_replica_{self.replica}",
            hostname=os.environ["MASTER_ADDR"],  # where the peers reach this group (its store's host)
            init_sync=False,  # every replica initializes the same weights from job.seed
        )

    def average(self, parts: list[nn.Module], loss: torch.Tensor) -> bool:
        """Average the gradients of ``parts`` and ``loss`` (in place) over the replicas in this step's
        quorum. False: the step did not commit (a replica was lost during it); run it again."""
        manager = self.manager
        assert manager is not None, "join() first"
        if not self.quorum_open:
            before = manager.current_step()
            manager.start_quorum()
            if manager.current_step() != before:
                raise ReplicaOutOfStep(
                    f"replica {self.replica} was at step {before} while its peers committed "
                    f"{manager.current_step()}; restarting it to heal from them"
                )
        self.quorum_open = False
        params = [p for part in parts for p in part.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # e.g. an expert no token reached: it contributes zeros
                p.grad = torch.zeros_like(p)
        # FSDP's gradients are DTensors: this rank's shard is what rank i of each replica averages.
        grads = [local_tensor(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1).float()])
        manager.allreduce(flat).wait()
        # What modules counted for their once-a-step update (an MoE router's expert loads) is summed
        # across the replicas too, so that every replica's update, e.g. its routing bias, is the same.
        stats = step_statistics(parts)
        counted = torch.cat([t.reshape(-1) for t in stats]) if stats else None
        if counted is not None:
            manager.allreduce(counted, reduce_op=ReduceOp.SUM).wait()
        committed = manager.should_commit()
        if counted is not None:
            _unflatten_into(stats, counted if committed else torch.zeros_like(counted))  # rerun: recount
        if committed:
            _unflatten_into(grads, flat)
            loss.copy_(flat[-1])
            assert self.loader is not None
            self.position = self.loader.state_dict()
        return committed

    def participants(self) -> int:
        """Replicas in the last step's quorum (the ``replicas`` field of each metrics line)."""
        return self.manager.num_participants() if self.manager is not None else 0

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank of this replica group: one answer that all of them act on."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=ReduceOp.MAX)
    return bool(value.item())


def _unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``, in order."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def local_shards(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each DTensor as this rank's shard: what crosses to the same rank of a healing
    replica (plain tensors, so the transport needs no device mesh)."""
    return tree_map_only(DTensor, lambda t: t.to_local(), state)


def as_shards_of(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A peer's :func:`local_shards` made DTensors again, laid out as this rank's ``current`` state.

    Matched by name, not by position: the peer's optimizer groups also carry what its learning-rate
    schedule added (``initial_lr``), which a replica that is still restoring has not built yet.
    """
    return {
        part: {name: _shard_like(value, current[part].get(name)) for name, value in values.items()}
        for part, values in saved.items()
    }


def _shard_like(value: Any, like: Any) -> Any:
    if not isinstance(like, DTensor):
        return value
    return DTensor.from_local(
        value, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )

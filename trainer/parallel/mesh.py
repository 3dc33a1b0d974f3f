"""The device mesh every parallelism is cut from.

One 5-D mesh, outermost to innermost: pipeline stages, FSDP replicas, FSDP shards, context parallel,
tensor parallel. Tensor parallelism is innermost so its chatty per-layer collectives stay between
neighbouring ranks (the same node); context parallel's ring of K/V passes comes next, since every
attention waits on it; pipeline's point-to-point traffic is outermost because it tolerates slow links.
Size-1 dims are kept, so every layout exposes the same axis names and code never branches on them.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ParallelConfig
from trainer.failures import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(cfg: ParallelConfig, device_type: str) -> DeviceMesh:
    """The (pp, dp_replicate, dp_shard, cp, tp) mesh over the current process group."""
    world = dist.get_world_size()
    if cfg.world_size != world:  # the spec checked its own degrees; a hand-typed torchrun may disagree
        raise UserError(
            f"torchrun started {world} processes but the spec's parallel degrees (dp_replicate×dp_shard×cp×tp×pp) "
            f"give world size {cfg.world_size}; launch with --nproc-per-node {cfg.world_size}, change the spec, "
            "or set faults.min_nodes for a job that may run on fewer nodes"
        )
    return init_device_mesh(
        device_type, (cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.tp), mesh_dim_names=MESH_DIMS
    )


def check_mesh(mesh: DeviceMesh) -> None:
    """Fail loudly if a mesh was not built by build_mesh: every parallelism indexes it by name."""
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(f"expected a mesh with dims {MESH_DIMS}, got {mesh.mesh_dim_names}")


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh FSDP shards over: 2-D (HSDP) when there are replicas, else 1-D.

    Context-parallel ranks hold identical parameters and see different tokens, so, as in torchtitan,
    FSDP shards over dp_shard×cp flattened: the gradient average over it is the cp and dp average at once.
    """
    shard = "dp_shard"
    if mesh["cp"].size() > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard]


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process in the flattened replicate×shard data-parallel group.

    cp ranks share a coordinate: they read the same rows and each trains on its chunks of them.
    """
    shards = mesh["dp_shard"].size()
    rank = mesh.get_local_rank("dp_replicate") * shards + mesh.get_local_rank("dp_shard")
    return rank, mesh["dp_replicate"].size() * shards

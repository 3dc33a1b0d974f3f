"""The planner's context parallelism: memory per chip, ring attention's K/V traffic and its overlap.

Reference point: torchtitan trains Llama 3 8B at 262,144 tokens on 8 H100 with CP=8 (the shipped
``gpu-llama3-8b-long-context.yaml``).
"""

from __future__ import annotations

import pytest

from trainer.config import CheckpointConfig, HardwareConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.plan import make_plan
from trainer.plan.hbm import activation_bytes
from trainer.plan.layout import Geometry

LLAMA3_8B = ModelConfig(preset="llama3-8b")
LONG = TrainConfig(seq_len=262_144, global_batch_size=8, micro_batch_size=1)
H100_NODE = HardwareConfig(accelerator="gpu", chip="h100-sxm", chips_per_node=8)


def parallel(**degrees: int) -> ParallelConfig:
    return ParallelConfig(activation_checkpointing="full", mixed_precision="bf16", **degrees)


def test_cp_divides_activations_and_shards_parameters_like_fsdp() -> None:
    cp8, fsdp8 = (Geometry(LLAMA3_8B, p, LONG, "gpu") for p in (parallel(cp=8), parallel(dp_shard=8)))
    # A chip holds 1/8 of every sequence...
    assert activation_bytes(cp8)[0] == pytest.approx(activation_bytes(fsdp8)[0] / 8)
    # ...and, as FSDP shards over dp_shard×cp, 1/8 of the parameters, as dp_shard=8 does.
    assert cp8.chip_params == fsdp8.chip_params
    plan = make_plan(LLAMA3_8B, parallel(cp=8), LONG, H100_NODE, CheckpointConfig())
    assert plan.fits  # torchtitan's run fits in 80 GB; without CP a 262k sequence's activations alone do not
    assert not make_plan(LLAMA3_8B, parallel(dp_shard=8), LONG, H100_NODE, CheckpointConfig()).fits


def test_ring_traffic_is_the_kv_passes_and_attention_hides_it_on_nvlink() -> None:
    plan = make_plan(LLAMA3_8B, parallel(cp=8), LONG, H100_NODE, CheckpointConfig())
    ring = next(p for p in plan.placement if p.dim == "cp")
    # One hop: K and V of 262,144 / 8 tokens × 8 kv heads × 128 dims in bf16; gradients in fp32.
    kv, grads = 2 * 32_768 * 1024 * 2, 2 * 32_768 * 1024 * 4
    # Per block and micro-batch: forward and its recompute 7 hops each, backward 7 K/V + 8 gradient hops.
    per_block = 3 * 7 * kv + 8 * grads
    assert ring.bytes_per_step == pytest.approx(per_block * 32 * 8)  # 32 layers, 8 micro-batches
    assert ring.time_s == pytest.approx(ring.bytes_per_step / 450e9 + (3 * 7 + 8) * 32 * 8 * 5e-6)
    # A 32k-query ring step of attention outlasts a 128 MiB hop over NVLink: only the last gradient
    # hop of each block shows.
    exposed = plan.time_breakdown.exposed_comm_s["cp"]
    assert exposed == pytest.approx(32 * 8 * (5e-6 + grads / 450e9))
    assert exposed < 0.1 * ring.time_s


def test_nothing_hides_the_ring_on_cpu() -> None:
    # gloo's copies run on the cores the compute saturates (as for FSDP on CPU).
    train = TrainConfig(seq_len=1024, global_batch_size=2, micro_batch_size=1)
    cpu = HardwareConfig(accelerator="cpu", chip="cpu", chips_per_node=2)
    plan = make_plan(ModelConfig(preset="tiny"), ParallelConfig(cp=2), train, cpu, CheckpointConfig())
    ring = next(p for p in plan.placement if p.dim == "cp")
    assert ring.time_s > 0
    assert plan.time_breakdown.exposed_comm_s["cp"] == pytest.approx(ring.time_s)

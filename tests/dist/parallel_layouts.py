"""torchrun worker (4 processes, gloo): train every layout 3 steps on the same data as a 1-process reference.

Run by tests/test_parallel.py. Each layout is built with ``build_parallel_model`` in the same processes
(one launch for all of them), trains STEPS AdamW steps on identical global batches, and rank 0 writes
{"reference": {"untied"|"tied": curves}, "layouts": {name: curves + "stored_copies" + its config}}
to argv[1]. stored_copies is how many times the parameters are held across all ranks (1 when fully
sharded, dp_replicate under HSDP). Every layout must also expose exactly the reference model's
state-dict FQNs (checkpoints reshard across layouts by name).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from trainer.config import JobConfig
from trainer.model import Transformer, param_count
from trainer.parallel import ParallelModel, build_parallel_model, token_loss

WORLD = 4
STEPS, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 3, 16, 8, 2
# MAX_NORM sits below the initial grad norm, so clipping is exercised on every step.
LR, MAX_NORM = 1e-2, 0.5
MODEL = dict(
    preset="custom", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, rope_theta=1e4
)
TIED = {**MODEL, "tie_embeddings": True}

# name -> (model dims, parallel section). Every layout uses all 4 processes.
SHARDED_INIT = "ddp2_tp2_sharded_init"  # run after LAYOUTS: built on meta, only local shards initialized
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fsdp4": (MODEL, dict(dp_shard=4)),
    "hsdp2x2_selective_ac": (MODEL, dict(dp_replicate=2, dp_shard=2, activation_checkpointing="selective")),
    "dp2_tp2": (MODEL, dict(dp_shard=2, tp=2)),
    "dp2_tp2_full_ac": (MODEL, dict(dp_shard=2, tp=2, activation_checkpointing="full")),
    "dp2_tp2_tied": (TIED, dict(dp_shard=2, tp=2)),
    "pp2_dp2_gpipe": (MODEL, dict(pp=2, dp_shard=2, pp_schedule="gpipe")),
    "pp2_dp2_1f1b": (MODEL, dict(pp=2, dp_shard=2, pp_schedule="1f1b")),
    "pp2_dp2_interleaved": (
        MODEL,
        dict(pp=2, dp_shard=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
    ),
    "pp2_tp2_1f1b": (MODEL, dict(pp=2, tp=2, pp_schedule="1f1b")),
    "fsdp4_bf16": (MODEL, dict(dp_shard=4, mixed_precision="bf16")),
}


def job_for(model: dict[str, Any], parallel: dict[str, Any]) -> JobConfig:
    return JobConfig.model_validate(
        {
            "seed": 7,
            "model": model,
            "parallel": parallel,
            "train": {
                "steps": STEPS,
                "seq_len": SEQ_LEN,
                "global_batch_size": GLOBAL_BATCH,
                "micro_batch_size": MICRO_BATCH,
            },
            "hardware": {"chips_per_node": WORLD},
        }
    )


def global_batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences from random starts: learnable, so the loss curve actually moves."""
    starts = torch.randint(vocab, (GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(100 + step))
    tokens = (starts + torch.arange(SEQ_LEN + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train_reference(job: JobConfig) -> dict[str, list[float]]:
    """The unparallelized model on the whole global batch: what every layout must reproduce."""
    model = Transformer(job.model, max_seq_len=SEQ_LEN)
    model.init_weights(job.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    curves: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        inputs, targets = global_batch(step, job.model.vocab_size)
        loss = token_loss(model(inputs), targets)
        loss.backward()
        curves["grad_norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        curves["loss"].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return curves


def train_layout(job: JobConfig, init_whole: bool) -> dict[str, Any]:
    pm = build_parallel_model(job, torch.device("cpu"), init_whole_max_params=2**30 if init_whole else 0)
    if not init_whole:
        check_replicas_agree(pm)
    optimizer = torch.optim.AdamW([p for part in pm.parts for p in part.parameters()], lr=LR)
    rows = GLOBAL_BATCH // pm.dp_size
    n_microbatches = rows // MICRO_BATCH
    curves: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in range(STEPS):
        inputs, targets = global_batch(step, job.model.vocab_size)
        local = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        loss = pm.forward_backward(inputs[local], targets[local], n_microbatches)
        curves["grad_norm"].append(pm.clip_grad_norm_(MAX_NORM).item())
        curves["loss"].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    check_fqns(pm, job)
    curves["stored_copies"] = stored_copies(pm, job)
    return curves


def check_replicas_agree(pm: ParallelModel) -> None:
    """Shard-by-shard init must give every dp replica the same values, or replicas silently diverge."""
    group = pm.mesh["dp_replicate"].get_group()
    for part in pm.parts:
        for name, param in part.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, local.detach().contiguous(), group=group)
            assert all(torch.equal(copy, copies[0]) for copy in copies), f"replicas differ at {name}"


def stored_copies(pm: ParallelModel, job: JobConfig) -> float:
    """Parameter elements held by all ranks together, in units of the model's size."""
    local = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        for part in pm.parts
        for p in part.parameters()
    )
    total = torch.tensor(float(local))
    dist.all_reduce(total)
    with torch.device("meta"):
        return total.item() / param_count(Transformer(job.model, max_seq_len=SEQ_LEN))


def check_fqns(pm: ParallelModel, job: JobConfig) -> None:
    """The union of every rank's state-dict keys is exactly the unsplit model's, wrappers stripped."""
    local = {key for part in pm.parts for key in get_model_state_dict(part)}
    gathered: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    with torch.device("meta"):
        expected = set(Transformer(job.model, max_seq_len=SEQ_LEN).state_dict())
    union = set().union(*gathered)
    assert union == expected, (
        f"FQNs differ: extra {sorted(union - expected)}, missing {sorted(expected - union)}"
    )


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == WORLD, f"run with --nproc-per-node {WORLD}"
    results: dict[str, Any] = {"reference": {}, "layouts": {}}
    if dist.get_rank() == 0:
        results["reference"] = {
            "untied": train_reference(job_for(MODEL, {"dp_shard": WORLD})),
            "tied": train_reference(job_for(TIED, {"dp_shard": WORLD})),
        }
    runs = [(name, model, parallel, True) for name, (model, parallel) in LAYOUTS.items()]
    # The large-model path: built on meta, parallelized, then only local shards are initialized.
    runs.append((SHARDED_INIT, MODEL, dict(dp_replicate=2, tp=2), False))
    for name, model, parallel, init_whole in runs:
        job = job_for(model, parallel)
        start = time.perf_counter()
        run: dict[str, Any] = train_layout(job, init_whole)
        run.update(
            seconds=time.perf_counter() - start,
            parallel=job.parallel.model_dump(),
            tied=job.model.tie_embeddings,
            init="whole" if init_whole else "sharded",
        )
        results["layouts"][name] = run
        if dist.get_rank() == 0:
            print(f"{name}: {run}", flush=True)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

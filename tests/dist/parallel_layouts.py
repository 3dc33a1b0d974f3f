"""torchrun worker (4 processes, gloo): train every layout 3 steps on the same data as a 1-process reference.

Run by tests/test_parallel.py. Each layout is built with ``build_parallel_model`` in the same processes
(one launch for all of them), trains STEPS AdamW steps on identical global batches, and rank 0 writes
{"reference": {"untied"|"tied": curves}, "layouts": {name: curves + "stored_copies" + "data_parallel" +
its config}} to argv[1], plus "ring_attention_error" and the "*_reshard_error"s (tests/dist/cp_checks.py).
stored_copies is how many times the parameters are held across all ranks (1 when fully sharded,
dp_replicate under HSDP or DDP); data_parallel names the wrapper ("ddp" or "fsdp"). Every layout must
also expose exactly the reference model's state-dict FQNs (checkpoints reshard across layouts by name).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate import DDP
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.dist.cp_checks import reshard_max_error, ring_attention_max_error
from trainer.config import JobConfig
from trainer.rank.local_tensor import local_tensor
from trainer.models import family_of, param_count
from trainer.models.moe import MoE
from trainer.parallel import ParallelModel, build_parallel_model, token_loss
from trainer.parallel.context import shard_sequence
from trainer.rank.step_hooks import after_optimizer_step

WORLD = 4
STEPS, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 3, 16, 8, 2
# MAX_NORM sits below the initial grad norm, so clipping is exercised on every step.
LR, MAX_NORM = 1e-2, 0.5
MODEL = dict(
    preset="custom", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, rope_theta=1e4
)
TIED = {**MODEL, "tie_embeddings": True}
# Every other layer a mixture of experts (4 routed, top-2, one shared); a large balancing weight so the
# auxiliary loss visibly shapes the gradients.
MOE = {
    **MODEL,
    "moe": dict(
        n_experts=4, top_k=2, shared_experts=1, every_n_layers=2, expert_ffn_dim=64, aux_loss_coef=0.1
    ),
}
# DeepSeek-V3's bias balancing on top of the auxiliary loss, with a large rate so the biases steer routing
# within the run; its biases must move identically on every layout (loads summed over every data rank).
MOE_BIAS = {**MODEL, "moe": {**MOE["moe"], "balance": "bias", "bias_update_rate": 0.05}}
BIAS_STEPS = 5
# Document masking with per-document RoPE; a 32-token vocabulary puts the end-of-text id (0) in about
# half of the counting rows, so rows hold one or two documents.
DOCUMENT = {**MODEL, "vocab_size": 32, "attention": "document", "rope_positions": "document"}
EOS_ID = 0  # the bias first acts on step 2: more steps for a missing all-reduce to show in the loss
# The DeepSeek family: MLA (low-rank query; values narrower than queries and keys), a dense first layer,
# then MoE with V3's routing (sigmoid, normalised, scaled) balanced by bias and auxiliary loss together.
DEEPSEEK = {
    **MODEL,
    "preset": "deepseek-custom",
    "n_kv_heads": 4,
    "mla": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "moe": dict(
        n_experts=4,
        top_k=2,
        shared_experts=1,
        expert_ffn_dim=64,
        first_dense_layers=1,
        score="sigmoid",
        routed_scale=2.5,
        balance="bias",
        aux_loss_coef=0.1,
        bias_update_rate=0.05,
    ),
}
# Under a pipeline, balanced by the auxiliary loss alone (the spec refuses balance: bias with pp > 1).
DEEPSEEK_AUX = {**DEEPSEEK, "moe": {**DEEPSEEK["moe"], "balance": "aux_loss", "bias_update_rate": None}}

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
    "pp2_dp2_interleaved_zb": (
        MODEL,
        dict(pp=2, dp_shard=2, pp_schedule="interleaved_zero_bubble", pp_virtual_stages=2),
    ),
    "pp2_dp2_zbv": (MODEL, dict(pp=2, dp_shard=2, pp_schedule="zbv_zero_bubble", pp_virtual_stages=2)),
    # DualPipeV needs a micro-batch per stage (4): tp instead of dp keeps the whole batch on each pp rank.
    "pp2_tp2_dualpipev": (MODEL, dict(pp=2, tp=2, pp_schedule="dualpipev", pp_virtual_stages=2)),
    "fsdp4_bf16": (MODEL, dict(dp_shard=4, mixed_precision="bf16")),
    "cp2_fsdp2": (MODEL, dict(dp_shard=2, cp=2)),
    "document_fsdp2_tp2": (DOCUMENT, dict(dp_shard=2, tp=2)),
    "cp2_tp2_full_ac": (MODEL, dict(cp=2, tp=2, activation_checkpointing="full")),
    "moe_fsdp4": (MOE, dict(dp_shard=4)),
    "moe_ep2_fsdp2": (MOE, dict(dp_shard=4, ep=2)),
    "moe_hsdp2x2_ep2": (MOE, dict(dp_replicate=2, dp_shard=2, ep=2)),  # experts replicated, not sharded
    # dp 2 → 2 micro-batches per rank: checks the auxiliary loss is weighed like each micro-batch's loss.
    "moe_ep2_tp2": (MOE, dict(dp_shard=2, tp=2, ep=2)),
    "moe_bias_ep2_fsdp2": (MOE_BIAS, dict(dp_shard=4, ep=2)),
    "moe_bias_ep2_tp2": (MOE_BIAS, dict(dp_shard=2, tp=2, ep=2)),  # tp ranks see the same tokens
    # Pure data parallelism: DDP (trainer/parallel/replicate.py), with 2 micro-batches (see MICRO_BATCHES)
    # so its gradients are reduced once, after accumulating both. In bf16 it stays on FSDP.
    "ddp4": (MODEL, dict(dp_replicate=4)),
    "ddp4_bf16": (MODEL, dict(dp_replicate=4, mixed_precision="bf16")),
    "moe_ddp4": (MOE, dict(dp_replicate=4)),
    # MoE through a pipeline: the schedule scales the auxiliary loss's gradient with the token loss's.
    "moe_pp2_dp2_1f1b": (MOE, dict(pp=2, dp_shard=2, pp_schedule="1f1b")),
    "deepseek_fsdp4": (DEEPSEEK, dict(dp_shard=4)),
    "deepseek_ep2_fsdp2": (DEEPSEEK, dict(dp_shard=4, ep=2)),
    "deepseek_aux_pp2_dp2_1f1b": (DEEPSEEK_AUX, dict(pp=2, dp_shard=2, pp_schedule="1f1b")),
}
# Sequences per micro-batch where MICRO_BATCH would leave a layout a single micro-batch per step.
MICRO_BATCHES = {"ddp4": 1, "moe_ddp4": 1}


def job_for(model: dict[str, Any], parallel: dict[str, Any], micro_batch: int = MICRO_BATCH) -> JobConfig:
    return JobConfig.model_validate(
        {
            "seed": 7,
            "model": model,
            "parallel": parallel,
            "train": {
                "steps": BIAS_STEPS if model.get("moe", {}).get("balance") == "bias" else STEPS,
                "seq_len": SEQ_LEN,
                "global_batch_size": GLOBAL_BATCH,
                "micro_batch_size": micro_batch,
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
    model = build(job)
    model.init_weights(job.seed)
    model.eos_id = EOS_ID
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    curves: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in range(job.train.steps):
        inputs, targets = global_batch(step, job.model.vocab_size)
        loss = token_loss(model(inputs), targets)
        loss.backward()
        curves["grad_norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        curves["loss"].append(loss.item())
        optimizer.step()
        after_optimizer_step([model])
        optimizer.zero_grad()
    return curves


def build(job: JobConfig) -> torch.nn.Module:
    """The unparallelized model of job's family, on the current default device."""
    return family_of(job.model).build(job.model, SEQ_LEN)


def train_layout(job: JobConfig, init_whole: bool) -> dict[str, Any]:
    pm = build_parallel_model(job, torch.device("cpu"), init_whole_max_params=2**30 if init_whole else 0)
    for part in pm.parts:  # no dataset here to read it from (build_parallel_model's source)
        part.eos_id = EOS_ID
    if not init_whole:
        check_replicas_agree(pm)
    optimizer = torch.optim.AdamW([p for part in pm.parts for p in part.parameters()], lr=LR)
    rows = GLOBAL_BATCH // pm.dp_size
    n_microbatches = rows // job.train.micro_batch_size
    curves: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in range(job.train.steps):
        inputs, targets = global_batch(step, job.model.vocab_size)
        local = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        loss = pm.forward_backward(inputs[local], targets[local], n_microbatches)
        curves["grad_norm"].append(pm.clip_grad_norm_(MAX_NORM).item())
        curves["loss"].append(loss.item())
        optimizer.step()
        after_optimizer_step(pm.parts, pm.mesh)
        optimizer.zero_grad()
    check_fqns(pm, job)
    curves["logits_per_rank"] = logits_per_rank(pm, inputs[:1])
    curves["vocab_size"] = job.model.vocab_size
    curves["stored_copies"] = stored_copies(pm, job)
    curves["data_parallel"] = data_parallel(pm)
    return curves


def logits_per_rank(pm: ParallelModel, inputs: torch.Tensor) -> int | None:
    """How many vocabulary entries of each token's logits this rank's head produces (None: a pipeline,
    whose head runs inside its schedule). Under TP, V/tp: the loss runs split, never gathering them."""
    if pm.stages:
        return None
    (model,) = pm.parts
    with torch.no_grad():
        logits = model(shard_sequence(inputs, pm.mesh["cp"]))
    return local_tensor(logits).shape[-1]


def reference_name(job: JobConfig) -> str:
    """Which single-process reference curve a layout must reproduce."""
    if job.model.mla:
        return "deepseek" if job.model.moe.balance == "bias" else "deepseek_aux"
    if job.model.moe:
        return "moe_bias" if job.model.moe.balance == "bias" else "moe"
    if job.model.attention == "document":
        return "document"
    return "tied" if job.model.tie_embeddings else "untied"


def data_parallel(pm: ParallelModel) -> str:
    """Which wrapper holds the parameters: "ddp" (composable replicate) or "fsdp" (fully_shard)."""
    (kind,) = {
        "ddp" if isinstance(part, DDP) else "fsdp" if isinstance(part, FSDPModule) else "none"
        for part in pm.parts
    }
    return kind


def check_replicas_agree(pm: ParallelModel) -> None:
    """Shard-by-shard init must give every dp replica the same values, or replicas silently diverge."""
    group = pm.mesh["dp_replicate"].get_group()
    for part in pm.parts:
        for name, param in part.named_parameters():
            local = local_tensor(param)
            copies = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, local.detach().contiguous(), group=group)
            assert all(torch.equal(copy, copies[0]) for copy in copies), f"replicas differ at {name}"


def stored_copies(pm: ParallelModel, job: JobConfig) -> float:
    """Parameter elements held by all ranks together, in units of the model's size."""
    local = sum(local_tensor(p).numel() for part in pm.parts for p in part.parameters())
    total = torch.tensor(float(local))
    dist.all_reduce(total)
    with torch.device("meta"):
        return total.item() / param_count(build(job))


def moe_fraction(job: JobConfig) -> float:
    """Share of the parameters in MoE layers, which TP leaves whole on every tp rank."""
    with torch.device("meta"):
        model = build(job)
    moe = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.parameters())
    return moe / param_count(model)


def check_fqns(pm: ParallelModel, job: JobConfig) -> None:
    """The union of every rank's state-dict keys is exactly the unsplit model's, wrappers stripped."""
    local = {key for part in pm.parts for key in get_model_state_dict(part)}
    gathered: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    with torch.device("meta"):
        expected = set(build(job).state_dict())
    union = set().union(*gathered)
    assert union == expected, (
        f"FQNs differ: extra {sorted(union - expected)}, missing {sorted(expected - union)}"
    )


def reshard_errors(model: dict[str, Any], pairs: list[tuple[str, str]], work: Path) -> dict[str, float]:
    """Largest parameter error of each (saved layout → loaded layout) checkpoint round trip."""
    return {
        f"{saved}->{loaded}": reshard_max_error(
            job_for(model, LAYOUTS[saved][1]), job_for(model, LAYOUTS[loaded][1]), work / saved
        )
        for saved, loaded in pairs
    }


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == WORLD, f"run with --nproc-per-node {WORLD}"
    results: dict[str, Any] = {"reference": {}, "layouts": {}}
    results["ring_attention_error"] = ring_attention_max_error()
    work = Path(out_path).parent
    # A CP run's checkpoint loads into plain FSDP, and a plain one into CP×FSDP (DCP reshards by name).
    results["cp_reshard_error"] = reshard_errors(
        MODEL, [("cp2_tp2_full_ac", "fsdp4"), ("fsdp4", "cp2_fsdp2")], work
    )
    # DDP's plain tensors load into FSDP×TP's DTensors, and back.
    results["ddp_reshard_error"] = reshard_errors(MODEL, [("ddp4", "dp2_tp2"), ("dp2_tp2", "ddp4")], work)
    # Experts split over ep ranks load into plain FSDP, and back into EP×TP.
    results["moe_reshard_error"] = reshard_errors(
        MOE, [("moe_ep2_fsdp2", "moe_fsdp4"), ("moe_fsdp4", "moe_ep2_tp2")], work
    )
    if dist.get_rank() == 0:
        results["reference"] = {
            "untied": train_reference(job_for(MODEL, {"dp_shard": WORLD})),
            "tied": train_reference(job_for(TIED, {"dp_shard": WORLD})),
            "moe": train_reference(job_for(MOE, {"dp_shard": WORLD})),
            "moe_bias": train_reference(job_for(MOE_BIAS, {"dp_shard": WORLD})),
            "document": train_reference(job_for(DOCUMENT, {"dp_shard": WORLD})),
            "deepseek": train_reference(job_for(DEEPSEEK, {"dp_shard": WORLD})),
            "deepseek_aux": train_reference(job_for(DEEPSEEK_AUX, {"dp_shard": WORLD})),
        }
    runs = [(name, model, parallel, True) for name, (model, parallel) in LAYOUTS.items()]
    # The large-model path: built on meta, parallelized, then only local shards are initialized.
    runs.append((SHARDED_INIT, MODEL, dict(dp_replicate=2, tp=2), False))
    for name, model, parallel, init_whole in runs:
        job = job_for(model, parallel, MICRO_BATCHES.get(name, MICRO_BATCH))
        start = time.perf_counter()
        run: dict[str, Any] = train_layout(job, init_whole)
        run.update(
            seconds=time.perf_counter() - start,
            parallel=job.parallel.model_dump(),
            tied=job.model.tie_embeddings,
            reference=reference_name(job),
            moe_fraction=moe_fraction(job),
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

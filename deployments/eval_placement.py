"""Where a run's checkpoints are evaluated: in the flow's own process, or as a Job on the training pool.

Evaluation holds the whole model in one process (``trainer/evaluate.py``: fp32 weights, one batch at
a time). A Kubernetes flow run is a small orchestrator pod (``ORCHESTRATOR_POD``, 4 GiB), which holds
that only for small models: an 8B model's weights alone are 32 GB. Anything larger runs as a one-pod
Job on the training pool, whose nodes have the host memory the training pods have. A local run (the
CPU pool) evaluates in the flow's process: its host is the training host.

Validation needs no such choice: it is streamed (``trainer/checkpoint/validate.py``), holding a fixed
budget rather than the model, so it runs in the flow's process everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deployments.pools import ORCHESTRATOR_MEMORY_GIB
from deployments.spec import TrainingSpec
from trainer.plan.params import active_ffn_dim, count_params
from trainer.units import GiB

EVAL_BYTES_PER_PARAM = 4  # trainer.evaluate builds the model in fp32 and loads the fp32 master weights
FP32 = 4
# Share of the orchestrator's memory evaluation may take: the rest is the flow process itself (Python,
# Prefect, torch: ~1 GiB), the concurrent validation's budget, and allocator slack.
HEADROOM = 0.5


@dataclass(frozen=True)
class EvalPlacement:
    where: Literal["flow", "training_pool"]
    needed_bytes: float  # the estimate of evaluation's peak memory
    why: str

    @property
    def line(self) -> str:
        """One line for the plan: where evaluation runs and why."""
        place = "in the flow's process" if self.where == "flow" else "as a Job on the training pool"
        return f"{place}: {self.why}"


def eval_memory_bytes(spec: TrainingSpec) -> float:
    """Peak bytes of evaluating one checkpoint in one process: the fp32 weights, the largest saved tensor
    DCP reads beside them, and one batch's forward (``eval.batches`` run one after another): the fp32
    logits plus the loss's log-probabilities, and one block's widest intermediates (SwiGLU's three
    ffn-wide tensors, q/k/v/output)."""
    model = spec.model
    tokens = spec.train.micro_batch_size * spec.train.seq_len
    weights = count_params(model).total * EVAL_BYTES_PER_PARAM
    largest_tensor = max(model.vocab_size, active_ffn_dim(model)) * model.dim * FP32
    logits = 2 * tokens * model.vocab_size * FP32
    block = tokens * (3 * active_ffn_dim(model) + 4 * model.dim) * FP32
    return weights + largest_tensor + logits + block


def eval_placement(spec: TrainingSpec) -> EvalPlacement:
    """In the flow's process when that is the training host or evaluation fits the orchestrator pod with
    :data:`HEADROOM`; otherwise a Job on ``spec.cluster.pool``."""
    needed = eval_memory_bytes(spec)
    if spec.cluster.accelerator == "cpu":
        return EvalPlacement("flow", needed, "a local run, whose flow runs on the training host")
    limit = HEADROOM * ORCHESTRATOR_MEMORY_GIB * GiB
    estimate = f"~{needed / GiB:.1f} GiB (fp32 weights + one batch)"
    if needed <= limit:
        return EvalPlacement(
            "flow", needed, f"{estimate} fits in half the {ORCHESTRATOR_MEMORY_GIB} GiB orchestrator pod"
        )
    return EvalPlacement(
        "training_pool",
        needed,
        f"{estimate} is more than half the {ORCHESTRATOR_MEMORY_GIB} GiB orchestrator pod; "
        f"one node of {spec.cluster.pool}",
    )

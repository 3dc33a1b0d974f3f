"""The work pools tessera deploys to: one per accelerator family.

``tessera-cpu`` is a process pool (flow runs are local processes that launch torchrun on the same
host); the accelerator pools are Kubernetes pools whose base job templates live in
``deployments/templates/`` as real prefect-kubernetes templates (``job_configuration`` + ``variables``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

TEMPLATE_DIR = Path(__file__).parent / "templates"
# The flow-run pod only orchestrates (the training job gets the chips): no accelerator, small.
# deployments/eval_placement.py evaluates in it only models that fit in this memory.
ORCHESTRATOR_MEMORY_GIB = 4
ORCHESTRATOR_POD = {
    "node_selector": {},
    "tolerations": [],
    "resources": {
        "requests": {"cpu": "1", "memory": f"{ORCHESTRATOR_MEMORY_GIB}Gi"},
        "limits": {"memory": f"{ORCHESTRATOR_MEMORY_GIB}Gi"},
    },
}


@dataclass(frozen=True)
class Pool:
    name: str
    type: str  # Prefect worker type
    accelerator: str
    description: str


POOLS: dict[str, Pool] = {
    p.accelerator: p
    for p in [
        Pool("tessera-cpu", "process", "cpu", "Local CPU runs: torchrun over gloo on the worker's host."),
        Pool("tessera-gpu", "kubernetes", "gpu", "NVIDIA GPU nodes (NCCL over NVLink + EFA) on Kubernetes."),
        Pool("tessera-tpu", "kubernetes", "tpu", "Google TPU slices on GKE."),
        Pool("tessera-trainium", "kubernetes", "trainium", "AWS Trainium (Neuron + EFA) nodes on EKS."),
    ]
}


@cache
def _load_template(accelerator: str) -> str:
    return (TEMPLATE_DIR / f"{accelerator}.json").read_text()


def base_job_template(accelerator: str) -> dict[str, Any]:
    """The pool's base job template (a fresh copy); the CPU pool uses the process worker's default."""
    if POOLS[accelerator].type == "process":
        from prefect.workers.process import ProcessWorker

        return ProcessWorker.get_default_base_job_template()
    return json.loads(_load_template(accelerator))

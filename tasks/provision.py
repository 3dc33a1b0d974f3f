"""Provision the cluster a job trains on, and guarantee it is torn down.

``local`` (accelerator ``cpu``) is this host: ``nodes`` torchrun agents on loopback sharing one c10d
rendezvous stand in for nodes. ``kubernetes`` (gpu/tpu/trainium) is a rendered, schema-validated
Indexed Job + headless Service + ConfigMap; each training attempt (re)submits it through the
Kubernetes API, and tear-down deletes it. Use :func:`provisioned`, whose ``finally`` tears down on
success, failure and cancellation alike (Prefect turns cancellation into an exception in the flow).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prefect import get_run_logger, task

from deployments.kubernetes import (
    Manifest,
    delete_manifests,
    render_manifests,
    validate_manifests,
    write_manifests,
)
from deployments.spec import TrainingSpec
from tasks.agents import stop_recorded_agents
from tasks.paths import run_dir
from trainer.config import JobConfig
from trainer.launch import write_job
from trainer.plan import Plan


@dataclass(frozen=True)
class Cluster:
    """Everything the train task needs to launch and follow the job; passed between tasks."""

    kind: Literal["local", "kubernetes"]
    run_dir: Path
    job_path: Path
    nodes: int
    procs_per_node: int
    rdzv_endpoint: str | None = None  # local multi-node only; k8s pods find pod 0 by DNS
    manifests: list[Manifest] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@task(name="provision", tags=["provision"])
def provision_task(spec: TrainingSpec, job: JobConfig) -> Cluster:
    """Write the job file and, for Kubernetes pools, the validated manifests; return the handle."""
    directory = run_dir(spec)
    job_path = write_job(job, directory)
    cluster = spec.cluster
    if cluster.accelerator == "cpu":
        endpoint = f"127.0.0.1:{free_port()}" if cluster.nodes > 1 else None
        return Cluster("local", directory, job_path, cluster.nodes, cluster.chips_per_node, endpoint)
    manifests = render_manifests(spec, job)
    validate_manifests(manifests)
    path = write_manifests(manifests, directory / "manifests")
    get_run_logger().info("rendered %d manifests to %s", len(manifests), path)
    return Cluster(
        "kubernetes", directory, job_path, cluster.nodes, cluster.chips_per_node, manifests=manifests
    )


@task(name="teardown", tags=["provision"])
def teardown_task(cluster: Cluster) -> None:
    """Delete the Kubernetes objects, or stop local agents a cancelled or crashed train task left running."""
    if cluster.kind == "kubernetes":
        delete_manifests(cluster.manifests)
    elif stopped := stop_recorded_agents(cluster.run_dir):
        get_run_logger().warning("stopped %d torchrun agent(s) left running: %s", len(stopped), stopped)


@contextmanager
def provisioned(spec: TrainingSpec, job: JobConfig, after: Plan | None = None) -> Iterator[Cluster]:
    """Provision for the body, tear down after it. ``after`` (the plan) orders provisioning behind it
    and draws that edge in the run graph."""
    cluster = provision_task(spec, job, wait_for=[after] if after is not None else None)
    try:
        yield cluster
    finally:
        teardown_task(cluster)

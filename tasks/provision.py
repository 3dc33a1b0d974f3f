"""Provision where a run trains, and guarantee it is torn down.

``local`` (accelerator ``cpu``) is this host: ``nodes`` torchrun agents on loopback sharing one c10d
rendezvous stand in for nodes. ``kubernetes`` (gpu/tpu/trainium) is a rendered, schema-validated
JobSet + ConfigMap (:mod:`deployments.kubernetes`); each training attempt (re)submits it through the
Kubernetes API, and tear-down deletes it. Use :func:`provisioned`, whose ``finally`` tears down on
success, failure and cancellation alike (Prefect turns cancellation into an exception in the flow);
owner references and TTLs cover an orchestrator that dies before it can.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from prefect import get_run_logger, task

from deployments.kubernetes.client import delete_manifests
from deployments.kubernetes.render import (
    Manifest,
    render_manifests,
    validate_manifests,
    write_manifests,
)
from deployments.run import Run
from trainer.plan import Plan
from trainer.runtime.agents import stop_recorded_agents


@dataclass(frozen=True)
class LaunchTarget:
    """Where and how the train task launches the run: passed from provision to train and teardown."""

    kind: Literal["local", "kubernetes"]
    run: Run
    rdzv_endpoint: str | None = None  # local multi-node only; k8s pods find pod 0 by DNS
    manifests: list[Manifest] = field(default_factory=list)

    def local_commands(self) -> list[list[str]]:
        """One torchrun agent per simulated node, all in one rendezvous."""
        nodes = self.run.spec.cluster.nodes
        return [self.run.torchrun_command(node, self.rdzv_endpoint) for node in range(nodes)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@task(name="provision")
def provision_task(run: Run) -> LaunchTarget:
    """A rendezvous port for local agents, or the validated Kubernetes manifests of the run."""
    cluster = run.spec.cluster
    if cluster.accelerator == "cpu":
        return LaunchTarget("local", run, f"127.0.0.1:{free_port()}" if cluster.nodes > 1 else None)
    manifests = render_manifests(run)
    validate_manifests(manifests)
    path = write_manifests(manifests, run.dir.manifests)
    get_run_logger().info("rendered %d manifests to %s", len(manifests), path)
    return LaunchTarget("kubernetes", run, manifests=manifests)


@task(name="teardown")
def teardown_task(target: LaunchTarget) -> None:
    """Delete the Kubernetes objects, or stop local agents a cancelled or crashed train task left running."""
    # First, so that a train task whose agents are stopped here ends instead of retrying them.
    target.run.dir.stopping.touch()
    if target.kind == "kubernetes":
        delete_manifests(target.manifests)
    elif stopped := stop_recorded_agents(target.run.dir):
        get_run_logger().warning("stopped %d torchrun agent(s) left running: %s", len(stopped), stopped)


@contextmanager
def provisioned(run: Run, after: Plan | None = None) -> Iterator[LaunchTarget]:
    """Provision for the body, tear down after it. ``after`` (the plan) orders provisioning behind it
    and draws that edge in the run graph."""
    target = provision_task(run, wait_for=[after] if after is not None else None)
    run.dir.stopping.unlink(missing_ok=True)  # a retried flow run trains again
    try:
        yield target
    finally:
        teardown_task(target)

"""tessera's Kubernetes client code end to end against a FAKE API server (tests/k8s_fake.py).

Not a cluster: no Kubernetes API server installs here, so these drive the real ``kubernetes`` client
and ``deployments.kubernetes`` over HTTP against an in-process fake that stores objects, checks
JobSets against the vendored CRD schema, cascades deletes through ownerReferences, and stands in for
the Job and JobSet controllers by applying the rendered failure policies as documented. What they
prove: the calls, their order, ownership, status reading and deletion. What they do not: the real
controllers' behaviour, which ``make k8s-smoke`` checks on a real cluster.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from prefect import flow

from deployments.kubernetes.client import apply_manifests, delete_manifests, jobset_status
from deployments.kubernetes.render import render_manifests
from deployments.run import Run
from deployments.spec import SPEC_DIR, load_spec
from tasks.provision import provisioned
from tests.k8s_fake import FakeCluster
from trainer.failures import EXIT_USER_ERROR, classify_exit
from trainer.rundir import RunDir

NAMESPACE = "default"


def gpu_run(runs: Path | None = None) -> Run:
    spec = load_spec(SPEC_DIR / "gpu-llama3-8b-h100.yaml")
    spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"nodes": 2})})
    spec = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"dp_shard": 16})})
    root = runs or Path(tempfile.mkdtemp())
    return Run.open(spec, RunDir(root / f"{spec.name}-0123abcd"), data_url="s3://b/d/manifest.json")


def kinds(cluster: FakeCluster) -> set[tuple[str, str]]:
    return {(resource, name) for resource, _, name in cluster.objects if resource != "pods"}


def test_apply_follow_restart_fail_and_delete(cluster: FakeCluster) -> None:
    manifests = render_manifests(gpu_run())
    jobset = manifests[-1]
    name = jobset["metadata"]["name"]
    apply_manifests(manifests)
    assert kinds(cluster) == {("jobsets", name), ("configmaps", f"{name}-job")}
    config_map = cluster.objects[("configmaps", NAMESPACE, f"{name}-job")]
    (owner,) = config_map["metadata"]["ownerReferences"]  # goes with the JobSet
    assert owner["kind"] == "JobSet" and owner["uid"] == cluster.jobset(NAMESPACE, name)["metadata"]["uid"]
    assert jobset_status(jobset).state == "running" and len(cluster.pods(jobset)) == 2

    # A node failure (kill -9, exit 137) restarts the whole gang within maxRestarts; so does an
    # eviction, which costs no restart.
    assert cluster.fail_pod(NAMESPACE, name, exit_code=137) == "RestartJobSet"
    assert cluster.fail_pod(NAMESPACE, name, exit_code=None) == "RestartJobSetAndIgnoreMaxRestarts"
    status = jobset_status(jobset)
    assert (status.state, status.restarts) == ("running", 2)

    # A user error fails the JobSet at once, and the train task does not retry it.
    log = "error: [rank 3] loss is nan at step 7; lower optimizer.lr"
    assert cluster.fail_pod(NAMESPACE, name, exit_code=EXIT_USER_ERROR, log=log) == "FailJobSet"
    status = jobset_status(jobset)
    assert (status.state, status.exit_code, status.log_tail) == ("failed", EXIT_USER_ERROR, log)
    assert classify_exit(status.exit_code, status.log_tail) == "user_error"

    delete_manifests(manifests, poll_s=0.05)
    assert kinds(cluster) == set() and cluster.pods(jobset) == []
    deletes = [path for method, path in cluster.requests if method == "DELETE"]
    assert any(f"/jobsets/{name} propagationPolicy=Foreground" in d for d in deletes)


def test_node_failures_past_max_restarts_fail_the_jobset_as_a_node_failure(cluster: FakeCluster) -> None:
    manifests = render_manifests(gpu_run())
    name = manifests[-1]["metadata"]["name"]
    apply_manifests(manifests)
    actions = [cluster.fail_pod(NAMESPACE, name, exit_code=5) for _ in range(3)]
    assert actions == ["RestartJobSet", "RestartJobSet", "FailJobSet"]  # faults.max_restarts = 2
    status = jobset_status(manifests[-1])
    assert status.state == "failed" and classify_exit(status.exit_code, status.log_tail) == "node_failure"


def test_a_jobset_the_api_server_rejects_is_one_error_naming_the_field(cluster: FakeCluster) -> None:
    from kubernetes.client.exceptions import ApiException

    manifests = render_manifests(gpu_run())
    manifests[-1]["spec"]["failurePolicy"]["maxRestarts"] = "two"
    with pytest.raises(ApiException, match=r"spec\.failurePolicy\.maxRestarts: 'two' is not of type"):
        apply_manifests(manifests)


def test_a_flow_run_pod_owns_the_jobset_so_deleting_the_flow_run_deletes_it(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The flow run as Prefect's Kubernetes worker runs it: a pod of the flow run's Job.
    flow_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "flow-run-abc"}}
    _, created = cluster.create("jobs", NAMESPACE, flow_job)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "flow-run-abc-xyz12",
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "flow-run-abc",
                    "uid": created["metadata"]["uid"],
                    "controller": True,
                }
            ],
        },
    }
    cluster.create("pods", NAMESPACE, pod)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")  # no token file: falls back to KUBECONFIG
    monkeypatch.setenv("HOSTNAME", "flow-run-abc-xyz12")
    manifests = render_manifests(gpu_run())
    apply_manifests(manifests)
    name = manifests[-1]["metadata"]["name"]
    (owner,) = cluster.jobset(NAMESPACE, name)["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("Job", "flow-run-abc")
    # Prefect cancels a Kubernetes flow run by deleting its Job (and a crashed one's Job goes at its
    # TTL); the garbage collector then takes the JobSet, its ConfigMap and its pods.
    cluster.delete("jobs", NAMESPACE, "flow-run-abc")
    assert kinds(cluster) == set()


class Cancelled(Exception):
    """What a cancelled flow run's body sees: Prefect delivers cancellation as an exception raised in
    the flow (TerminationSignal after SIGTERM, which the engine then re-sends to end the process; a
    test cannot raise that one in its own process, so this stands in for it)."""


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_cancelling_the_flow_run_deletes_what_it_applied(
    cluster: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_RUNS_DIR", str(tmp_path / "runs"))
    run = gpu_run(tmp_path / "runs")
    applied: list[str] = []

    @flow
    def cancelled() -> None:
        with provisioned(run) as target:
            apply_manifests(target.manifests)  # what the train task does first
            applied.extend(name for _, name in kinds(cluster))
            raise Cancelled

    with pytest.raises(Cancelled):
        cancelled()
    assert len(applied) == 2 and kinds(cluster) == set()
    assert not any(resource == "pods" for resource, _, _ in cluster.objects)

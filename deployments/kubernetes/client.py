"""Apply, follow and delete a run's rendered objects through the Kubernetes API (the optional
``tessera[kubernetes]`` extra): deterministic names make every step idempotent, and the flow run's own
Job owns what it creates, so nothing outlives the flow run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal

from deployments.kubernetes.render import JOBSET_API, JOBSET_GROUP, Manifest


def api_client() -> Any:
    """The kubernetes client (optional extra ``tessera[kubernetes]``), configured in-cluster or from kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise RuntimeError(
            "applying manifests needs the kubernetes extra: pip install 'tessera[kubernetes]'"
        ) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # KUBECONFIG as it is now: the client reads it once, at import, otherwise.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    return client


# Kinds sent as plain JSON through the generic group/version/plural API: the JobSet (a custom
# resource), and the evaluation Job, whose typed client would refuse the integer quantities
# ("nvidia.com/gpu": 8) the pool templates hold and the API server accepts.
_PLAIN_KINDS = {"JobSet": (JOBSET_GROUP, JOBSET_API, "jobsets"), "Job": ("batch", "v1", "jobs")}


class _Objects:
    """Create, read and delete the kinds tessera applies (JobSet, Job, ConfigMap), by manifest."""

    def __init__(self, client: Any) -> None:
        self.client, self.core, self.custom = client, client.CoreV1Api(), client.CustomObjectsApi()

    def create(self, manifest: Manifest) -> Manifest:
        """Create ``manifest``; the object as stored (with its uid)."""
        namespace = manifest["metadata"]["namespace"]
        if manifest["kind"] in _PLAIN_KINDS:
            group, version, plural = _PLAIN_KINDS[manifest["kind"]]
            return self.custom.create_namespaced_custom_object(group, version, namespace, plural, manifest)
        created = self.core.create_namespaced_config_map(namespace, manifest)
        return self.client.ApiClient().sanitize_for_serialization(created)

    def read(self, manifest: Manifest) -> Manifest:
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        if manifest["kind"] in _PLAIN_KINDS:
            group, version, plural = _PLAIN_KINDS[manifest["kind"]]
            return self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)
        found = self.core.read_namespaced_config_map(name, namespace)
        return self.client.ApiClient().sanitize_for_serialization(found)

    def delete(self, manifest: Manifest) -> None:
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        # Foreground: the JobSet is gone only once its Jobs and pods are, so a new attempt cannot collide.
        options = self.client.V1DeleteOptions(propagation_policy="Foreground")
        if manifest["kind"] in _PLAIN_KINDS:
            group, version, plural = _PLAIN_KINDS[manifest["kind"]]
            self.custom.delete_namespaced_custom_object(group, version, namespace, plural, name, body=options)
        else:
            self.core.delete_namespaced_config_map(name, namespace, body=options)

    def exists(self, manifest: Manifest) -> bool:
        try:
            self.read(manifest)
        except self.client.exceptions.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True


def with_owner(manifest: Manifest, owner: Manifest | None) -> Manifest:
    """``manifest`` owned by ``owner`` (an object as stored, with its uid): deleted with it."""
    if owner is None:
        return manifest
    reference = {k: owner[k] for k in ("apiVersion", "kind")} | {
        k: owner["metadata"][k] for k in ("name", "uid")
    }
    return {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": [reference]}}


def orchestrator_job(client: Any, namespace: str) -> Manifest | None:
    """The Job running this flow run when it runs as a pod of ``namespace`` (Prefect's Kubernetes
    worker), to own the training JobSet: deleting the flow run's Job (Prefect's cancel, its TTL after
    a crash) then removes the JobSet too. None elsewhere (owners cannot cross namespaces)."""
    pod_name = os.environ.get("HOSTNAME")
    if not os.environ.get("KUBERNETES_SERVICE_HOST") or not pod_name:
        return None
    try:
        pod = client.CoreV1Api().read_namespaced_pod(pod_name, namespace)
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    for owner in pod.metadata.owner_references or []:
        if owner.controller and owner.kind == "Job":
            return {
                "apiVersion": owner.api_version,
                "kind": "Job",
                "metadata": {"name": owner.name, "uid": owner.uid},
            }
    return None


def apply_manifests(manifests: list[Manifest]) -> None:
    """Create the JobSet, or the evaluation Job (owned by the flow run's Job where there is one), then
    the objects it owns, first removing leftovers of an earlier attempt (names are deterministic). The
    pods wait for the ConfigMap's volume, so creating it second costs them nothing."""
    client = api_client()
    objects = _Objects(client)
    delete_manifests(manifests)
    jobset = next(m for m in manifests if m["kind"] in ("JobSet", "Job"))
    created = objects.create(with_owner(jobset, orchestrator_job(client, jobset["metadata"]["namespace"])))
    for manifest in manifests:
        if manifest is not jobset:
            objects.create(with_owner(manifest, created))


def delete_manifests(manifests: list[Manifest], wait_s: float = 300.0, poll_s: float = 2.0) -> None:
    """Delete the objects (a JobSet with its Jobs and pods) and wait until they are gone; missing ones
    are fine, so tear-down is idempotent and a following create cannot collide with a terminating object."""
    client = api_client()
    objects = _Objects(client)
    for manifest in reversed(manifests):  # the JobSet first: it stops the pods
        try:
            objects.delete(manifest)
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
    deadline = time.monotonic() + wait_s
    for manifest in manifests:
        while objects.exists(manifest):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{manifest['kind']} {manifest['metadata']['name']} still exists after {wait_s:.0f} s"
                )
            time.sleep(poll_s)


@dataclass(frozen=True)
class JobSetStatus:
    """Where the training JobSet stands; when it failed, the first failed pod's exit code and log tail."""

    state: Literal["running", "succeeded", "failed"]
    restarts: int  # gang restarts so far, by the JobSet's failure policy
    exit_code: int = 0
    log_tail: str = ""


def _condition(jobset: Manifest, kind: str) -> bool:
    conditions = (jobset.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def jobset_status(jobset: Manifest) -> JobSetStatus:
    """Read the JobSet's status (it restarts the gang itself for as long as its policy allows)."""
    client = api_client()
    name, namespace = jobset["metadata"]["name"], jobset["metadata"]["namespace"]
    live = _Objects(client).read(jobset)
    restarts = int((live.get("status") or {}).get("restarts") or 0)
    if _condition(live, "Completed"):
        return JobSetStatus("succeeded", restarts)
    if not _condition(live, "Failed"):
        return JobSetStatus("running", restarts)
    return JobSetStatus(
        "failed", restarts, *_failed_pod(client, namespace, f"jobset.sigs.k8s.io/jobset-name={name}")
    )


def job_status(job: Manifest) -> JobSetStatus:
    """Read a plain Job's status (the evaluation Job), in the same terms; it has no gang restarts."""
    client = api_client()
    live = _Objects(client).read(job)
    if _condition(live, "Complete"):
        return JobSetStatus("succeeded", 0)
    if not _condition(live, "Failed"):
        return JobSetStatus("running", 0)
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    return JobSetStatus("failed", 0, *_failed_pod(client, namespace, f"batch.kubernetes.io/job-name={name}"))


def _failed_pod(client: Any, namespace: str, selector: str) -> tuple[int, str]:
    """The exit code and log tail of the first pod matching ``selector`` that exited non-zero."""
    core = client.CoreV1Api()
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        statuses = pod.status.container_statuses or []
        terminated = statuses and statuses[0].state.terminated
        if terminated and terminated.exit_code:
            return terminated.exit_code, core.read_namespaced_pod_log(
                pod.metadata.name, namespace, tail_lines=200
            )
    # No pod with an exit code: the pods went with their node (or were evicted and deleted).
    return 137, "pod lost (evicted or its node went away)"

"""Render, validate, apply and delete the multi-node training job for a Kubernetes work pool.

A flow run is one process, so training on N nodes is a Kubernetes job the provision task submits:
an Indexed Job with one pod per node, each running ``torchrun`` that joins one c10d rendezvous at
pod 0, reached through a headless Service (stable DNS ``<job>-0.<job>``), plus a ConfigMap holding
the trainer's job JSON. The pod shape comes from the pool's base job template
(``deployments/templates/<accelerator>.json``), so the pool and the training job share one source
of truth; the spec fills in image, chip counts, instance type and TPU slice topology. Names are
derived from the spec, so a retried provision finds (and replaces) the same objects.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Literal

import kubernetes_validate
import yaml
from prefect.utilities.templating import apply_values

from deployments.pools import base_job_template
from deployments.spec import TrainingSpec
from trainer.config import JobConfig
from trainer.launch import launch_env, torchrun_command

Manifest = dict[str, Any]

KUBERNETES_VERSION = "1.33.0"  # schema the manifests are validated against (GKE/EKS regular channels)
RDZV_PORT = 29400
JOB_DIR = "/etc/tessera"  # where the ConfigMap with job.json is mounted
RUN_DIR = "/var/run/tessera"  # per-pod scratch run dir; checkpoints go to spec.checkpoint.url

# Extended resource that counts one chip, per accelerator (device plugins' names).
CHIP_RESOURCE = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu", "trainium": "aws.amazon.com/neuron"}
# The instance type whose node holds chips_per_node chips; pods are pinned to it, one pod per node.
INSTANCE_TYPE = {
    "a100-80gb": "p4de.24xlarge",
    "h100-sxm": "p5.48xlarge",
    "h200": "p5e.48xlarge",
    "b200": "p6-b200.48xlarge",
    "trainium1": "trn1.32xlarge",
    "trainium2": "trn2.48xlarge",
}
# GKE's node label values for TPU slices (cloud.google.com/gke-tpu-accelerator).
TPU_ACCELERATOR = {"tpu-v5e": "tpu-v5-lite-podslice", "tpu-v5p": "tpu-v5p-slice", "tpu-v6e": "tpu-v6e-slice"}
TPU_3D = {"tpu-v5p"}  # v5p slices are 3-D tori; v5e/v6e are 2-D


class ManifestError(ValueError):
    """A rendered manifest the Kubernetes schema rejects; the message names the object and the field."""


def job_name(spec: TrainingSpec) -> str:
    """Deterministic, DNS-safe name of the training job (spec names are DNS labels of ≤ 48 chars)."""
    return f"tessera-{spec.name}"


def tpu_topology(chip: str, chips: int) -> str:
    """GKE slice topology for ``chips`` chips: double the smallest torus axis until the count is reached.

    That yields GKE's published shapes (v5p: 2x2x1, 2x2x2, 2x2x4, …, 4x8x8; v5e/v6e: 2x2, 2x4, 4x4, …).
    """
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a {chip} slice needs a power-of-two chip count, got cluster nodes×chips = {chips}")
    dims = [1, 1, 1] if chip in TPU_3D else [1, 1]
    while math.prod(dims) < chips:
        smallest = min(range(len(dims)), key=lambda i: (dims[i], -i))
        dims[smallest] *= 2
    return "x".join(str(d) for d in sorted(dims))


def placement(spec: TrainingSpec, defaults: dict[str, Any]) -> dict[str, Any]:
    """Node selector and resources for one pod of this spec, on top of the template's defaults."""
    cluster = spec.cluster
    selector = dict(defaults["node_selector"])
    if cluster.accelerator == "tpu":
        selector["cloud.google.com/gke-tpu-accelerator"] = TPU_ACCELERATOR[cluster.chip]
        selector["cloud.google.com/gke-tpu-topology"] = tpu_topology(cluster.chip, cluster.world_size)
    else:
        selector["node.kubernetes.io/instance-type"] = INSTANCE_TYPE[cluster.chip]
    resources = json.loads(json.dumps(defaults["resources"]))
    for section in resources.values():
        if CHIP_RESOURCE[cluster.accelerator] in section:
            section[CHIP_RESOURCE[cluster.accelerator]] = cluster.chips_per_node
    return {"node_selector": selector, "resources": resources}


def render_manifests(spec: TrainingSpec, job: JobConfig) -> list[Manifest]:
    """ConfigMap (job.json) + headless Service + Indexed Job for ``spec`` on its Kubernetes pool."""
    if spec.cluster.accelerator not in CHIP_RESOURCE:
        raise ValueError(f"cluster.accelerator={spec.cluster.accelerator} runs locally, not on Kubernetes")
    template = base_job_template(spec.cluster.accelerator)
    defaults = {
        k: v["default"]
        for k, v in template["variables"]["properties"].items()
        if v.get("default") is not None
    }
    name = job_name(spec)
    labels = {
        "app.kubernetes.io/name": "tessera",
        "app.kubernetes.io/instance": name,
        "tessera/run": spec.name,
    }
    # Every pod has its own host name, so c10d assigns node ranks; node_rank stays at its default.
    command = torchrun_command(
        Path(JOB_DIR, "job.json"),
        Path(RUN_DIR),
        nproc_per_node=spec.cluster.chips_per_node,
        nnodes=spec.cluster.nodes,
        rdzv_endpoint=f"{name}-0.{name}:{RDZV_PORT}",
        max_restarts=spec.faults.max_restarts,
        run_id=name,
    )
    command[0] = "python"  # the image's interpreter, not this host's sys.executable
    env = [{"name": k, "value": v} for k, v in sorted(launch_env(job, base={}).items())]
    values = {
        **defaults,
        **placement(spec, defaults),
        "name": name,
        "namespace": spec.cluster.namespace,
        "labels": labels,
        "image": spec.cluster.image,
        "command": command,
        "env": env,
    }
    manifest = apply_values(template["job_configuration"]["job_manifest"], values)
    metadata = manifest["metadata"]
    del metadata["generateName"]
    metadata["name"] = name
    nodes = spec.cluster.nodes
    manifest["spec"].update(completionMode="Indexed", completions=nodes, parallelism=nodes)
    pod = manifest["spec"]["template"]
    pod["metadata"] = {"labels": dict(labels)}
    pod["spec"]["subdomain"] = name  # pod DNS <job>-<index>.<service> for the rendezvous
    pod["spec"]["volumes"] = [{"name": "job", "configMap": {"name": f"{name}-job"}}]
    container = pod["spec"]["containers"][0]
    container["name"] = "trainer"
    container["ports"] = [{"name": "rdzv", "containerPort": RDZV_PORT}]
    container["volumeMounts"] = [{"name": "job", "mountPath": JOB_DIR, "readOnly": True}]
    if spec.cluster.credentials_secret:  # a reference: the values stay in the cluster's Secret
        container["envFrom"] = [{"secretRef": {"name": spec.cluster.credentials_secret}}]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-job", "namespace": spec.cluster.namespace, "labels": dict(labels)},
        "data": {"job.json": job.model_dump_json(indent=2)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": spec.cluster.namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",  # headless: DNS resolves straight to the pods
            "publishNotReadyAddresses": True,  # pods must find each other before they are Ready
            "selector": {"app.kubernetes.io/instance": name},
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
        },
    }
    return [config_map, service, manifest]


def validate_manifests(manifests: list[Manifest], version: str = KUBERNETES_VERSION) -> None:
    """Check each manifest against the Kubernetes OpenAPI schema (strict: unknown fields are errors)."""
    for manifest in manifests:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path) or "(root)"
            raise ManifestError(
                f"{manifest['kind']} {manifest['metadata']['name']}: {where}: {exc.message}"
            ) from None


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's job.json) as readable ``|`` blocks."""


_ManifestDumper.add_representer(
    str,
    lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def write_manifests(manifests: list[Manifest], out_dir: Path) -> Path:
    """Write all manifests as one multi-document YAML (what ``kubectl apply -f`` takes); return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{manifests[-1]['metadata']['name']}.yaml"
    path.write_text(yaml.dump_all(manifests, Dumper=_ManifestDumper, sort_keys=False))
    return path


def _api() -> Any:
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
        config.load_kube_config()
    return client


def _namespaced(client: Any, manifest: Manifest, verb: str) -> Any:
    """The client call ``verb`` (read/delete) for this manifest's kind, bound to its name and namespace."""
    api, noun = {
        "ConfigMap": ("CoreV1Api", "config_map"),
        "Service": ("CoreV1Api", "service"),
        "Job": ("BatchV1Api", "job"),
    }[manifest["kind"]]
    call = getattr(getattr(client, api)(), f"{verb}_namespaced_{noun}")
    return lambda **kwargs: call(manifest["metadata"]["name"], manifest["metadata"]["namespace"], **kwargs)


def apply_manifests(manifests: list[Manifest]) -> None:
    """Create the objects, first removing leftovers of an earlier attempt (names are deterministic)."""
    client = _api()
    from kubernetes.utils import create_from_dict

    delete_manifests(manifests)
    for manifest in manifests:
        create_from_dict(client.ApiClient(), manifest, namespace=manifest["metadata"]["namespace"])


def delete_manifests(manifests: list[Manifest], wait_s: float = 300.0) -> None:
    """Delete the objects (a Job with its pods) and wait until they are gone; missing ones are fine,
    so tear-down is idempotent and a following create cannot collide with a terminating object."""
    client = _api()
    for manifest in manifests:
        try:
            _namespaced(client, manifest, "delete")(propagation_policy="Foreground")
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
    deadline = time.monotonic() + wait_s
    for manifest in manifests:
        while time.monotonic() < deadline:
            try:
                _namespaced(client, manifest, "read")()
            except client.exceptions.ApiException as exc:
                if exc.status == 404:
                    break
                raise
            time.sleep(2)
        else:
            raise TimeoutError(
                f"{manifest['kind']} {manifest['metadata']['name']} still exists after {wait_s:.0f} s"
            )


def job_outcome(job: Manifest) -> tuple[Literal["running", "succeeded", "failed"], int, str]:
    """State of the training Job; when it failed, the first failed pod's exit code and log tail."""
    client = _api()
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    status = client.BatchV1Api().read_namespaced_job_status(name, namespace).status
    if (status.succeeded or 0) >= job["spec"]["completions"]:
        return "succeeded", 0, ""
    if not status.failed:
        return "running", 0, ""
    core = client.CoreV1Api()
    for pod in core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items:
        terminated = pod.status.container_statuses and pod.status.container_statuses[0].state.terminated
        if terminated and terminated.exit_code:
            tail = core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=200)
            return "failed", terminated.exit_code, tail
    return "failed", 137, "pod lost (evicted or its node went away)"  # no exit code: the node failed

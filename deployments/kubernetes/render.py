"""Render and validate the Kubernetes objects of a run: the training JobSet (or, with replica fault
tolerance, one Job per replica group and the Lighthouse), its ConfigMap, the evaluation Job and a
Kueue queue; and write them as YAML for ``kubectl apply -f``. Pure functions of a :class:`Run`: no
API server is reached here (:mod:`deployments.kubernetes.client` applies and follows them).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from prefect.utilities.templating import apply_values

from deployments.pools import base_job_template
from deployments.run import Run
from deployments.spec import TrainingSpec
from trainer import storage
from trainer.backends.chips import get_chip
from trainer.failures import EXIT_USER_ERROR
from trainer.replicas import LIGHTHOUSE_ENV, REPLICA_ENV
from trainer.runtime.launch import launch_env

Manifest = dict[str, Any]

KUBERNETES_VERSION = "1.33.0"  # schema the manifests are validated against (GKE/EKS regular channels)
JOBSET_VERSION = "v0.12.0"  # the JobSet release the manifests are written for (tests/schemas holds its CRD)
KUEUE_VERSION = "v0.19.2"  # the Kueue release whose JobSet integration admits them
JOBSET_GROUP, JOBSET_API = "jobset.x-k8s.io", "v1alpha2"
KUEUE_API = "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
REPLICATED_JOB = "node"  # pods are <jobset>-node-<replica group>-<index>
LIGHTHOUSE_JOB = "lighthouse"  # replica fault tolerance: the run's Lighthouse, pod <jobset>-lighthouse-0-0
RDZV_PORT = 29400
LIGHTHOUSE_PORT = 29510
# Without a chip: it only keeps the replicas' quorum (heartbeats and a few RPCs a step).
LIGHTHOUSE_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"  # which replica group a pod is in
MAX_RESTARTABLE_JOBS = 1024  # JobSet refuses RestartJob rules beyond this many replicas of a Job
JOB_DIR = "/etc/tessera"  # where the ConfigMap with job.json is mounted
RUN_DIR = "/var/run/tessera"  # per-pod scratch run dir; what must outlive the pod goes to the run URL
SHM_SIZE = "64Gi"  # /dev/shm: NCCL's intra-node buffers and DataLoader workers' shared tensors
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
POD_NAME_SUFFIX = len("-abcde")  # the random suffix the Job controller appends to pod names
DNS_LABEL_MAX = 63

# Extended resource that counts one chip, per accelerator (device plugins' names).
CHIP_RESOURCE = {"gpu": "nvidia.com/gpu", "tpu": "google.com/tpu", "trainium": "aws.amazon.com/neuron"}
# The instance type whose node holds chips_per_node chips; pods are pinned to it, one pod per node.
INSTANCE_TYPE = {
    "v100-32gb": "p3dn.24xlarge",
    "a100-40gb": "p4d.24xlarge",
    "a100-80gb": "p4de.24xlarge",
    "h100-sxm": "p5.48xlarge",
    "h200": "p5e.48xlarge",
    "b200": "p6-b200.48xlarge",
    "trainium1": "trn1.32xlarge",
    "trainium2": "trn2.48xlarge",
}
# GKE's node label values for TPU slices (cloud.google.com/gke-tpu-accelerator).
TPU_ACCELERATOR = {
    "tpu-v4": "tpu-v4-podslice",
    "tpu-v5e": "tpu-v5-lite-podslice",
    "tpu-v5p": "tpu-v5p-slice",
    "tpu-v6e": "tpu-v6e-slice",
}
TPU_3D = {"tpu-v4", "tpu-v5p"}  # v4 and v5p slices are 3-D tori; v5e/v6e are 2-D

# The Job's pod failure policy turns a pod's exit into a Job failure whose message the JobSet's
# failure policy matches (the Job controller writes "Container trainer for pod NS/NAME failed with exit
# code 3 matching FailJob rule at index 0", or "Pod NS/NAME has condition DisruptionTarget matching
# FailJob rule at index 1"). Any other exit (a node failure: 4, 5, a signal) exceeds backoffLimit 0.
POD_FAILURE_POLICY = {
    "rules": [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [EXIT_USER_ERROR]},
        },
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
}
# The evaluation Job: a user error fails it at once; an eviction is retried without counting.
EVAL_POD_FAILURE_POLICY = {
    "rules": [
        POD_FAILURE_POLICY["rules"][0],
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
}
# A bound on a hung evaluation, not a budget: a 70B model's forward on a host CPU takes minutes a batch.
EVAL_DEADLINE_S = 6 * 3600
JOBSET_FAILURE_RULES = [
    {  # retrying would fail the same way: no restart, whatever the budget
        "name": "UserError",
        "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"],
        "onJobFailureMessagePatterns": [f"failed with exit code {EXIT_USER_ERROR} matching FailJob rule"],
    },
    {  # preemption, eviction, a drained node: the job did nothing wrong, so it costs no restart
        "name": "Disruption",
        "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["PodFailurePolicy"],
        "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"],
    },
    # Anything else (BackoffLimitExceeded: a node failure) falls through to RestartJobSet, counted.
]
# Replica fault tolerance: a replica group's failure recreates that group's Job only, while the others
# train on (a Lighthouse that fails past its own retries still restarts everything).
REPLICA_FAILURE_RULES = [
    JOBSET_FAILURE_RULES[0],
    {
        **JOBSET_FAILURE_RULES[1],
        "action": "RestartJobAndIgnoreMaxRestarts",
        "targetReplicatedJobs": [REPLICATED_JOB],
    },
    {"name": "ReplicaLost", "action": "RestartJob", "targetReplicatedJobs": [REPLICATED_JOB]},
]


class ManifestError(ValueError):
    """A rendered manifest the schema rejects; the message names the object and the field."""


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


def replica_groups(spec: TrainingSpec) -> int:
    """Jobs of the replicated Job: one per replica group with replica fault tolerance, else one."""
    return spec.parallel.dp_replicate if spec.faults.replica_fault_tolerance else 1


def jobset_name(run: Run) -> str:
    """The run id, its spec-name part shortened if needed so that every pod name the JobSet derives
    (``<name>-node-<group>-<index>-<5 random>``) is a DNS label, which the JobSet webhook demands."""
    groups = replica_groups(run.spec)
    pods = [f"-{REPLICATED_JOB}-{groups - 1}-{run.spec.cluster.nodes // groups - 1}"]
    pods += [f"-{LIGHTHOUSE_JOB}-0-0"] if groups > 1 else []
    longest_suffix = max(map(len, pods)) + POD_NAME_SUFFIX
    budget = DNS_LABEL_MAX - longest_suffix
    if len(run.run_id) <= budget:
        return run.run_id
    spec_part, token = run.run_id.rsplit("-", 1)
    return f"{spec_part[: budget - len(token) - 1].rstrip('-')}-{token}"


def pod_hostnames(run: Run) -> list[str]:
    """Each pod's DNS name in this pod's Job through the JobSet's headless Service, by completion index:
    the whole gang, or with replica fault tolerance the pod's replica group (``$(REPLICA_GROUP_ID)``,
    which Kubernetes expands from the pod's environment)."""
    name = jobset_name(run)
    group = f"$({REPLICA_ENV})" if replica_groups(run.spec) > 1 else 0
    return [
        f"{name}-{REPLICATED_JOB}-{group}-{index}.{name}"
        for index in range(run.spec.cluster.nodes // replica_groups(run.spec))
    ]


def run_url(run: Run) -> str:
    """The run URL :meth:`Run.open` gave a Kubernetes run (``deployments.run.remote_run_url``); a run
    without one keeps its checkpoints on a local path, which pods cannot reach."""
    if run.job.run_url is None:
        raise ValueError(
            f"checkpoint.url={run.checkpoint_url!r} is a local path, which pods on other machines cannot "
            "share; set checkpoint.url to gs://bucket/path or s3://bucket/path for a Kubernetes run"
        )
    return run.job.run_url


def training_deadline_s(run: Run) -> int:
    """Seconds after which Kubernetes stops a training Job however it fares: three times the planned
    training time plus an hour (start-up, checkpoints, restarts), a bound on a runaway, not a budget."""
    return math.ceil(3 * run.spec.train.steps * run.plan.step_time_s) + 3600


def placement(spec: TrainingSpec, defaults: dict[str, Any]) -> dict[str, Any]:
    """Node selector and resources for one pod of this spec, on top of the template's defaults."""
    cluster = spec.cluster
    selector = dict(defaults["node_selector"])
    nodes = TPU_ACCELERATOR if cluster.accelerator == "tpu" else INSTANCE_TYPE
    if cluster.chip not in nodes:  # planned from the catalog, but no cloud node type known to carry it
        raise ManifestError(
            f"cluster.chip={cluster.chip} has no known Kubernetes node type to place pods on; use one of "
            f"{', '.join(c for c in nodes if get_chip(c).accelerator == cluster.accelerator)}"
        )
    if cluster.accelerator == "tpu":
        selector["cloud.google.com/gke-tpu-accelerator"] = TPU_ACCELERATOR[cluster.chip]
        slice_chips = cluster.world_size // replica_groups(spec)  # a replica group is a slice of its own
        selector["cloud.google.com/gke-tpu-topology"] = tpu_topology(cluster.chip, slice_chips)
    else:
        selector["node.kubernetes.io/instance-type"] = INSTANCE_TYPE[cluster.chip]
    resources = json.loads(json.dumps(defaults["resources"]))
    for section in resources.values():
        if CHIP_RESOURCE[cluster.accelerator] in section:
            section[CHIP_RESOURCE[cluster.accelerator]] = cluster.chips_per_node
    return {"node_selector": selector, "resources": resources}


def backend_env(run: Run) -> list[dict[str, Any]]:
    """The backend's launch variables as a container's environment."""
    return [{"name": k, "value": v} for k, v in sorted(launch_env(run.job, base={}).items())]


def pod_env(run: Run) -> list[dict[str, Any]]:
    """The trainer container's environment: the backend's launch variables, the pod's node rank from
    its completion index, and for TPU the slice's worker host names, which TorchTPU's launcher reads
    with the completion index to address every chip of the slice. With replica fault tolerance, also
    the pod's replica group (its Job's index in the JobSet) and where the Lighthouse is."""
    env = backend_env(run)
    env.append({"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}})
    if replica_groups(run.spec) > 1:  # before the TPU hosts: Kubernetes expands earlier variables only
        name = jobset_name(run)
        env += [
            {"name": REPLICA_ENV, "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}},
            {"name": LIGHTHOUSE_ENV, "value": f"http://{name}-{LIGHTHOUSE_JOB}-0-0.{name}:{LIGHTHOUSE_PORT}"},
        ]
    if run.spec.cluster.accelerator == "tpu":
        env += [
            {"name": "TPU_WORKER_ID", "value": "$(NODE_RANK)"},
            {"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(pod_hostnames(run))},
        ]
    return env


def render_manifests(run: Run) -> list[Manifest]:
    """ConfigMap (job.json, mirroring to the run URL) + JobSet of ``run`` on its Kubernetes pool."""
    if run.spec.cluster.accelerator not in CHIP_RESOURCE:
        raise ValueError(
            f"cluster.accelerator={run.spec.cluster.accelerator} runs locally, not on Kubernetes"
        )
    name = jobset_name(run)
    labels = {
        "app.kubernetes.io/name": "tessera",
        "app.kubernetes.io/instance": name,
        "tessera/run": run.run_id,
        "tessera/spec": run.spec.name,
    }
    namespace = run.spec.cluster.namespace
    run_url(run)  # a run the pods cannot mirror to is refused before anything is rendered
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-job", "namespace": namespace, "labels": dict(labels)},
        "data": {"job.json": run.job.model_dump_json(indent=2)},
    }
    return [config_map, training_jobset(run, name, labels)]


def training_jobset(run: Run, name: str, labels: dict[str, str]) -> Manifest:
    """The JobSet: the pool's base job template filled from the spec as its one replicated Job."""
    spec = run.spec
    template = base_job_template(spec.cluster.accelerator)
    defaults = _pool_defaults(template)
    groups = replica_groups(run.spec)
    if groups > MAX_RESTARTABLE_JOBS:
        raise ManifestError(
            f"parallel.dp_replicate={groups}: JobSet restarts one replica group's Job alone only up to "
            f"{MAX_RESTARTABLE_JOBS} of them; use at most {MAX_RESTARTABLE_JOBS} replica groups"
        )
    nodes = spec.cluster.nodes // groups  # of each Job: a replica group, or the whole gang
    torchrun = run.torchrun_command(
        node_rank=0,
        rdzv_endpoint=f"{pod_hostnames(run)[0]}:{RDZV_PORT}",
        job_path=Path(JOB_DIR, "job.json"),
        run_dir=Path(RUN_DIR),
        python="python",  # the image's interpreter, not this host's sys.executable
        nodes=nodes,
    )
    # Kubernetes expands $(NODE_RANK) from the pod's environment: each pod passes its own index.
    torchrun = [arg.replace("--node-rank=0", "--node-rank=$(NODE_RANK)") for arg in torchrun]
    values = {
        **defaults,
        **placement(spec, defaults),
        "name": name,
        "namespace": spec.cluster.namespace,
        "labels": labels,
        "image": spec.cluster.image,
        # An unset value drops the field (the namespace's default service account), as in the pool's template.
        **({"service_account_name": spec.cluster.service_account} if spec.cluster.service_account else {}),
        "command": ["python", "-m", "trainer.runtime.pod", "--run-dir", RUN_DIR, "--", *torchrun],
        "env": pod_env(run),
    }
    job = apply_values(template["job_configuration"]["job_manifest"], values)
    job_spec = job["spec"]
    del job_spec["ttlSecondsAfterFinished"]  # the JobSet's TTL governs; a child's would race its restarts
    job_spec.update(
        completionMode="Indexed",
        completions=nodes,
        parallelism=nodes,
        backoffLimit=0,  # any pod failure fails the Job, and the JobSet's policy decides what follows
        activeDeadlineSeconds=training_deadline_s(run),
        podFailurePolicy=copy.deepcopy(POD_FAILURE_POLICY),
    )
    _shape_pod(job_spec["template"], name, labels, spec.cluster.credentials_secret)
    jobs = [_replicated(REPLICATED_JOB, groups, job_spec, labels)]
    if groups > 1:
        jobs.append(_replicated(LIGHTHOUSE_JOB, 1, lighthouse_job(run, name, labels), labels))
    return _jobset(run, name, labels, jobs, defaults)


def lighthouse_job(run: Run, name: str, labels: dict[str, str]) -> Manifest:
    """The Lighthouse's Job: one chipless pod serving the replicas' quorums, ready once its status page
    answers; a crash is retried by the Job itself, not by restarting the replicas."""
    container: Manifest = {
        "name": LIGHTHOUSE_JOB,
        "image": run.spec.cluster.image,
        "command": ["python", "-m", "trainer.runtime.replica_groups", "--job", f"{JOB_DIR}/job.json"],
        "args": ["--port", str(LIGHTHOUSE_PORT)],
        "ports": [{"name": LIGHTHOUSE_JOB, "containerPort": LIGHTHOUSE_PORT}],
        "readinessProbe": {"httpGet": {"path": "/status", "port": LIGHTHOUSE_PORT}, "periodSeconds": 5},
        "resources": copy.deepcopy(LIGHTHOUSE_RESOURCES),
        "volumeMounts": [{"name": "job", "mountPath": JOB_DIR, "readOnly": True}],
    }
    account = run.spec.cluster.service_account
    pod: Manifest = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": "job", "configMap": {"name": f"{name}-job"}}],
        **({"serviceAccountName": account} if account else {}),
    }
    return {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": run.spec.faults.max_restarts,
        "activeDeadlineSeconds": training_deadline_s(run),
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }


def _replicated(job: str, replicas: int, job_spec: Manifest, labels: dict[str, str]) -> Manifest:
    return {
        "name": job,
        "replicas": replicas,
        "template": {"metadata": {"labels": dict(labels)}, "spec": job_spec},
    }


def _pool_defaults(template: Manifest) -> dict[str, Any]:
    """The pool template's variables that have a default."""
    return {
        k: v["default"]
        for k, v in template["variables"]["properties"].items()
        if v.get("default") is not None
    }


def _shape_pod(pod: Manifest, name: str, labels: dict[str, str], credentials_secret: str | None) -> None:
    """The trainer container's name, ports and mounts: the job file and a RAM-backed /dev/shm, which
    NCCL and data-loader workers need beyond the runtime's 64 MiB default."""
    pod["metadata"] = {"labels": dict(labels)}
    pod["spec"]["volumes"] = [
        {"name": "job", "configMap": {"name": f"{name}-job"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
    ]
    container = pod["spec"]["containers"][0]
    container["name"] = "trainer"
    container["ports"] = [{"name": "rdzv", "containerPort": RDZV_PORT}]
    container["volumeMounts"] = [
        {"name": "job", "mountPath": JOB_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if credentials_secret:  # a reference: the values stay in the cluster's Secret
        container["envFrom"] = [{"secretRef": {"name": credentials_secret}}]


def _jobset(
    run: Run, name: str, labels: dict[str, str], jobs: list[Manifest], defaults: dict[str, Any]
) -> Manifest:
    """The JobSet around the replicated Jobs: restart policy, DNS for the rendezvous, queue, and what
    success is (the training Jobs done: a Lighthouse never finishes by itself)."""
    ft = len(jobs) > 1
    cluster = run.spec.cluster
    exclusive = {EXCLUSIVE_TOPOLOGY: defaults["exclusive_topology"]}
    metadata: Manifest = {
        "name": name,
        "namespace": cluster.namespace,
        "labels": {**labels, **({QUEUE_LABEL: cluster.queue} if cluster.queue else {})},
        **({} if ft else {"annotations": exclusive}),
    }
    if ft:  # each replica group a topology domain (a TPU slice) of its own; the Lighthouse anywhere
        jobs[0]["template"]["metadata"]["annotations"] = exclusive
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_API}",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {
                "maxRestarts": run.spec.faults.max_restarts,
                "restartStrategy": "Recreate",
                "rules": copy.deepcopy(REPLICA_FAILURE_RULES if ft else JOBSET_FAILURE_RULES),
            },
            **(
                {"successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]}} if ft else {}
            ),
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name},
            "ttlSecondsAfterFinished": defaults["finished_job_ttl"],
            "replicatedJobs": jobs,
        },
    }


def eval_record_url(run: Run, step: int) -> str:
    """Where the evaluation Job writes its record: under the run URL, which the flow reads too."""
    return storage.join(run_url(run), "evals", f"step-{step:06d}.json")


def render_eval_manifests(run: Run, step: int, step_url: str) -> list[Manifest]:
    """ConfigMap (job.json) + a one-pod Job that evaluates ``step_url`` on one node of the training
    pool, for a model the orchestrator pod cannot hold (``deployments/eval_placement.py``): the training
    pod's image, node selector, resources and credentials, running ``python -m trainer.evaluate``."""
    spec = run.spec
    name = f"{jobset_name(run)}-eval-{step}"  # fixed per checkpoint: a retried task replaces its own Job
    labels = {
        "app.kubernetes.io/name": "tessera",
        "app.kubernetes.io/instance": name,
        "tessera/run": run.run_id,
        "tessera/spec": spec.name,
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-job", "namespace": spec.cluster.namespace, "labels": dict(labels)},
        "data": {"job.json": run.job.model_dump_json(indent=2)},
    }
    template = base_job_template(spec.cluster.accelerator)
    defaults = _pool_defaults(template)
    evaluate = [
        *("python", "-m", "trainer.evaluate", "--job", f"{JOB_DIR}/job.json", "--step-url", step_url),
        *(f"--batches={spec.eval.batches}", f"--sample-tokens={spec.eval.sample_tokens}"),
        # Kubernetes expands $(VAR) in args; $$ is its escape for a literal $.
        *("--sample-prompt", spec.eval.sample_prompt.replace("$", "$$")),
        *("--out", eval_record_url(run, step)),
    ]
    values = {
        **defaults,
        **placement(spec, defaults),
        "name": name,
        "namespace": spec.cluster.namespace,
        "labels": labels,
        "image": spec.cluster.image,
        **({"service_account_name": spec.cluster.service_account} if spec.cluster.service_account else {}),
        "command": evaluate,
        "env": backend_env(run),
    }
    job_spec = apply_values(template["job_configuration"]["job_manifest"], values)["spec"]
    job_spec.update(
        backoffLimit=1,  # one more try after a node failure; a user error fails at once (below)
        activeDeadlineSeconds=EVAL_DEADLINE_S,
        podFailurePolicy=copy.deepcopy(EVAL_POD_FAILURE_POLICY),
    )
    _shape_pod(job_spec["template"], name, labels, spec.cluster.credentials_secret)
    del job_spec["template"]["spec"]["containers"][0]["ports"]  # no rendezvous: one process
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": spec.cluster.namespace, "labels": dict(labels)},
        "spec": job_spec,
    }
    return [config_map, job]


def kueue_queue(run: Run) -> list[Manifest]:
    """The Kueue objects that admit this run's JobSet through ``cluster.queue``: a ResourceFlavor for
    the pool's nodes, a ClusterQueue whose quota is exactly this gang, and the LocalQueue in the
    namespace. An SRE's starting point (``tessera render`` writes them beside the JobSet; k8s-smoke
    applies them), not something a run creates: queues and quotas are the cluster's policy."""
    spec = run.spec
    if spec.cluster.queue is None:
        raise ValueError("cluster.queue is not set: the JobSet is not queued, so there is no queue to set up")
    template = base_job_template(spec.cluster.accelerator)
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    pod = placement(spec, defaults)
    nodes, pool = spec.cluster.nodes, spec.cluster.pool
    requests = {**pod["resources"]["limits"], **pod["resources"]["requests"]}  # a limit alone is the request
    quota = [
        {"name": resource, "nominalQuota": _times(requests[resource], nodes)}
        for resource in ("cpu", "memory", CHIP_RESOURCE[spec.cluster.accelerator])
    ]
    api = f"kueue.x-k8s.io/{KUEUE_API}"
    return [
        {
            "apiVersion": api,
            "kind": "ResourceFlavor",
            "metadata": {"name": pool},
            "spec": {"nodeLabels": pod["node_selector"], "tolerations": defaults["tolerations"]},
        },
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": pool},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": [q["name"] for q in quota],
                        "flavors": [{"name": pool, "resources": quota}],
                    }
                ],
            },
        },
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": spec.cluster.queue, "namespace": spec.cluster.namespace},
            "spec": {"clusterQueue": pool},
        },
    ]


def _times(quantity: int | str, n: int) -> int | str:
    """``n`` × a Kubernetes quantity such as 8, "180" or "1800Gi"."""
    text = str(quantity)
    digits = len(text) - len(text.lstrip("0123456789"))
    return quantity * n if isinstance(quantity, int) else f"{int(text[:digits]) * n}{text[digits:]}"


def replicated_jobs(jobset: Manifest) -> list[Manifest]:
    """Each replicated Job's template as the batch/v1 Job it becomes (for the core schema)."""
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": f"{jobset['metadata']['name']}-{rj['name']}-0",
                **rj["template"]["metadata"],
            },
            "spec": rj["template"]["spec"],
        }
        for rj in jobset["spec"]["replicatedJobs"]
    ]


def validate_manifests(manifests: list[Manifest], version: str = KUBERNETES_VERSION) -> None:
    """Check each core object, and the Jobs a JobSet creates, against the Kubernetes OpenAPI schema
    (strict: unknown fields are errors). The JobSet's own fields are checked against its CRD in the tests."""
    for manifest in manifests:
        for obj in replicated_jobs(manifest) if manifest["kind"] == "JobSet" else [manifest]:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
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

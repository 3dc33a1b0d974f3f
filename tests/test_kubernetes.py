"""Kubernetes rendering for each accelerator spec: JobSets valid against the Kubernetes schema and the
vendored JobSet and Kueue CRDs (tests/schemas), pinned by golden files, each gap of issue 18 checked,
and the pool templates, work pools and prefect.yaml consistent with the specs. The client code against
an API server is in tests/test_kubernetes_client.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from deployments.kubernetes.render import (
    CHIP_RESOURCE,
    EXCLUSIVE_TOPOLOGY,
    QUEUE_LABEL,
    ManifestError,
    jobset_name,
    kueue_queue,
    render_manifests,
    tpu_topology,
    validate_manifests,
    write_manifests,
)
from deployments.pools import POOLS, base_job_template
from deployments.run import Run
from deployments.spec import SPEC_DIR, SpecError, load_spec, parse_spec, read_yaml
from tessera.register import PREFECT_YAML, REPO_ROOT, render_prefect_yaml
from tests.crd_schemas import crd_errors
from trainer.failures import EXIT_HANG, EXIT_INFRA, EXIT_USER_ERROR
from trainer.rundir import RunDir
from trainer.runtime.launch import LaunchResult
from trainer.runtime.pod import pod_exit_code

GOLDEN = Path(__file__).parent / "golden"
ACCELERATOR_SPECS = ["gpu-llama3-8b-h100", "tpu-llama3-70b-v5p", "trainium-llama3-70b-trn2"]
DATA_URL = "s3://bucket/tessera/data/0123456789abcdef/manifest.json"  # fixed: data prep is not run here
RUN_TOKEN = "0123abcd"  # fixed: the goldens pin the object names, which are the run id


def run_of(name: str, **cluster: str) -> Run:
    spec = load_spec(SPEC_DIR / f"{name}.yaml")
    spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update=cluster)})
    return Run.open(spec, RunDir(Path(tempfile.mkdtemp()) / f"{spec.name}-{RUN_TOKEN}"), data_url=DATA_URL)


def rendered(name: str) -> list[dict]:
    return render_manifests(run_of(name))


@pytest.mark.parametrize("name", ACCELERATOR_SPECS)
def test_jobsets_pass_the_vendored_crd_schemas_and_match_golden(name: str, tmp_path: Path) -> None:
    manifests = rendered(name)
    validate_manifests(manifests)  # the ConfigMap and the Job each replicated job becomes: core schema
    assert [m["kind"] for m in manifests] == ["ConfigMap", "JobSet"]
    assert crd_errors(manifests[1]) == []  # the JobSet: JobSet v0.12.0's CRD, strict
    # The ConfigMap's job.json is the spec itself (checked below); the golden pins what rendering decides.
    manifests[0]["data"]["job.json"] = "<job config>"
    text = write_manifests(manifests, tmp_path).read_text()
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"rendering changed; review and rerun with UPDATE_GOLDEN=1 to accept ({golden})"
    )


def test_the_crd_check_is_strict_and_real() -> None:
    jobset = rendered("gpu-llama3-8b-h100")[1]
    jobset["spec"]["failurePolicy"]["maxRestart"] = 2  # a typo the API server would reject
    jobset["spec"]["failurePolicy"]["rules"][0]["action"] = "Retry"  # not in the CRD's enum
    errors = crd_errors(jobset)
    assert any("maxRestart" in e and "spec.failurePolicy" in e for e in errors), errors
    assert any("'Retry' is not one of" in e for e in errors), errors


@pytest.mark.parametrize("name", ACCELERATOR_SPECS)
def test_one_pod_per_node_with_the_nodes_chips_and_a_shared_rendezvous(name: str) -> None:
    run = run_of(name)
    spec = run.spec
    config_map, jobset = render_manifests(run)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == spec.cluster.nodes
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    assert (
        container["resources"]["limits"][CHIP_RESOURCE[spec.cluster.accelerator]]
        == spec.cluster.chips_per_node
    )
    network = jobset["spec"]["network"]  # JobSet's own headless Service: pods resolve before Ready
    assert network == {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": run.run_id}
    args = container["args"]
    assert args[:6] == ["python", "-m", "trainer.runtime.pod", "--run-dir", "/var/run/tessera", "--"]
    assert f"--rdzv-endpoint={run.run_id}-node-0-0.{run.run_id}:29400" in args
    assert (
        f"--nnodes={spec.cluster.nodes}" in args and f"--nproc-per-node={spec.cluster.chips_per_node}" in args
    )
    # Node ranks: each pod its completion index, which Kubernetes expands into the argument.
    assert "--node-rank=$(NODE_RANK)" in args
    (node_rank,) = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    job_json = json.loads(config_map["data"]["job.json"])
    assert job_json["data_url"] == DATA_URL
    assert job_json["run_url"] == f"{spec.checkpoint.url}/runs/{run.run_id}"  # telemetry leaves the pod
    assert CHIP_RESOURCE[spec.cluster.accelerator] in {t["key"] for t in pod["tolerations"]}


@pytest.mark.parametrize("name", ACCELERATOR_SPECS)
def test_every_pod_has_shm_requests_and_the_gang_policies(name: str) -> None:
    run = run_of(name)
    jobset = rendered(name)[1]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])  # TPU pods requested neither
    assert "serviceAccountName" not in pod and QUEUE_LABEL not in jobset["metadata"]["labels"]
    # Nothing outlives its flow run: a deadline on the Job, a TTL on the JobSet, none on the child Job.
    assert job["activeDeadlineSeconds"] > 3 * run.spec.train.steps * run.plan.step_time_s
    assert jobset["spec"]["ttlSecondsAfterFinished"] == 3600 and "ttlSecondsAfterFinished" not in job
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == run.spec.faults.max_restarts and job["backoffLimit"] == 0
    assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [EXIT_USER_ERROR]
    assert [r["action"] for r in policy["rules"]] == ["FailJobSet", "RestartJobSetAndIgnoreMaxRestarts"]
    topology = {"gpu": "eks.amazonaws.com/nodegroup", "tpu": "cloud.google.com/gke-nodepool"}
    assert jobset["metadata"]["annotations"][EXCLUSIVE_TOPOLOGY] == topology.get(
        run.spec.cluster.accelerator, "eks.amazonaws.com/nodegroup"
    )


def test_queue_and_service_account_come_from_the_spec_and_kueue_objects_pass_its_schemas() -> None:
    run = run_of("tpu-llama3-70b-v5p", queue="training", service_account="tessera-trainer")
    jobset = render_manifests(run)[1]
    assert jobset["metadata"]["labels"][QUEUE_LABEL] == "training"
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "tessera-trainer"
    assert crd_errors(jobset) == []
    flavor, cluster_queue, local_queue = kueue_queue(run)
    for manifest in (flavor, cluster_queue, local_queue):
        assert crd_errors(manifest) == [], manifest["kind"]  # Kueue v0.19.2's CRDs, strict
    assert local_queue["metadata"] == {"name": "training", "namespace": "default"}
    quota = {
        r["name"]: r["nominalQuota"]
        for r in cluster_queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    }
    assert quota == {"cpu": "12800", "memory": "25600Gi", "google.com/tpu": 256}  # 64 hosts: the whole gang
    with pytest.raises(ValueError, match=r"cluster\.queue is not set"):
        kueue_queue(run_of("gpu-llama3-8b-h100"))


def test_per_process_accelerator_environment() -> None:
    def env(name: str) -> dict[str, str]:
        container = rendered(name)[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"
        ][0]
        return {e["name"]: e.get("value", "") for e in container["env"]}

    trainium = env("trainium-llama3-70b-trn2")
    assert trainium["NEURON_RT_NUM_CORES"] == "8"  # one chip per process, not 16 × 8 for each of 16
    assert trainium["FI_PROVIDER"] == "efa"
    assert env("gpu-llama3-8b-h100")["FI_PROVIDER"] == "efa"
    assert env("gpu-llama3-8b-h100")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    tpu = env("tpu-llama3-70b-v5p")
    hosts = tpu["TPU_WORKER_HOSTNAMES"].split(",")
    assert len(hosts) == 64 and hosts[0] == "llama3-70b-v5p-0123abcd-node-0-0.llama3-70b-v5p-0123abcd"
    assert tpu["TPU_WORKER_ID"] == "$(NODE_RANK)"


def test_long_run_ids_give_dns_label_pod_names() -> None:
    run = run_of("tpu-llama3-70b-v5p")
    long = replace(run, dir=RunDir(run.dir.path.with_name(f"{'x' * 48}-0123abcd")))
    name = jobset_name(long)
    assert name.endswith("-0123abcd") and len(f"{name}-node-0-63-abcde") == 63
    assert jobset_name(run) == run.run_id


def test_a_kubernetes_run_needs_its_checkpoints_in_an_object_store(tmp_path: Path) -> None:
    spec = load_spec(SPEC_DIR / "gpu-llama3-8b-h100.yaml")
    local = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"url": str(tmp_path)})})
    run = Run.open(local, RunDir(tmp_path / f"{spec.name}-{RUN_TOKEN}"), data_url=DATA_URL)
    with pytest.raises(ValueError, match="pods on other machines cannot share"):
        render_manifests(run)


def test_store_credentials_reach_the_pods_by_secret_name_only() -> None:
    def trainer(name: str) -> dict:
        return rendered(name)[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"
        ][0]

    assert trainer("gpu-llama3-8b-h100")["envFrom"] == [{"secretRef": {"name": "tessera-s3"}}]
    assert "envFrom" not in trainer("tpu-llama3-70b-v5p")


def test_accelerator_specific_placement() -> None:
    def pod(name: str) -> dict:
        return rendered(name)[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]

    gpu = pod("gpu-llama3-8b-h100")
    assert gpu["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert gpu["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
    assert pod("tpu-llama3-70b-v5p")["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "4x8x8",
    }  # 64 hosts × 4 chips
    trn = pod("trainium-llama3-70b-trn2")
    assert trn["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn2.48xlarge"
    assert trn["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16


def test_a_pod_exits_with_the_contract_code_not_torchruns_1() -> None:
    def code(kind: str, worker: int) -> int:
        return pod_exit_code(LaunchResult(1 if kind != "ok" else 0, worker, kind, ""))  # type: ignore[arg-type]

    assert code("ok", 0) == 0
    assert code("user_error", 1) == EXIT_USER_ERROR  # a Python exception in a rank: not restarted
    assert code("node_failure", -9) == EXIT_INFRA and code("node_failure", EXIT_HANG) == EXIT_HANG


def test_tpu_topologies_follow_gke_slice_shapes() -> None:
    assert [tpu_topology("tpu-v5p", n) for n in (4, 8, 16, 32, 64, 128)] == [
        "1x2x2",
        "2x2x2",
        "2x2x4",
        "2x4x4",
        "4x4x4",
        "4x4x8",
    ]
    assert [tpu_topology("tpu-v6e", n) for n in (4, 8, 16, 256)] == ["2x2", "2x4", "4x4", "16x16"]
    with pytest.raises(ValueError, match="power-of-two"):
        tpu_topology("tpu-v5p", 12)


def test_schema_violation_names_object_and_field() -> None:
    manifests = rendered("gpu-llama3-8b-h100")
    job = manifests[1]["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [8]
    with pytest.raises(
        ManifestError, match=r"JobSet llama3-8b-h100-0123abcd: spec\.template\.spec\.containers\.0\.resources"
    ):
        validate_manifests(manifests)


def test_pool_templates_are_prefect_kubernetes_templates_differing_only_in_accelerator_defaults() -> None:
    templates = {a: base_job_template(a) for a, pool in POOLS.items() if pool.type == "kubernetes"}
    assert set(templates) == {"gpu", "tpu", "trainium"}
    configurations = [t["job_configuration"] for t in templates.values()]
    assert all(c == configurations[0] for c in configurations)
    for template in templates.values():
        variables = template["variables"]["properties"]
        assert {"image", "namespace", "node_selector", "tolerations", "resources", "env", "command"} <= set(
            variables
        )
    assert (
        base_job_template("cpu")["job_configuration"]["command"] == "{{ command }}"
    )  # process worker default


def test_prefect_yaml_is_generated_from_the_specs() -> None:
    assert PREFECT_YAML.read_text() == render_prefect_yaml(), "regenerate it: python -m tessera.register"
    config = yaml.safe_load(PREFECT_YAML.read_text())
    deployments = {(d["entrypoint"].rsplit(":", 1)[1], d["name"]): d for d in config["deployments"]}
    for spec_file in SPEC_DIR.glob("*.yaml"):
        pipeline = deployments[("train_pipeline", spec_file.stem)]
        assert pipeline["work_pool"]["name"] == load_spec(spec_file).cluster.pool
        assert load_spec(spec_file) == parse_spec(pipeline["parameters"]["spec"])
        assert deployments[("evaluate_checkpoints", spec_file.stem)]["schedules"][0]["interval"] > 0
    assert deployments[("train_pipeline", "nightly")]["schedules"][0]["cron"] == "0 3 * * *"


@pytest.mark.slow
def test_render_command_writes_valid_manifests_and_refuses_cpu_specs(tmp_path: Path) -> None:
    def tessera(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tessera.cli", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )

    ok = tessera(
        "render",
        "deployments/specs/trainium-llama3-70b-trn2.yaml",
        "--out",
        str(tmp_path),
        "--data-url",
        DATA_URL,
    )
    assert ok.returncode == 0, ok.stderr
    assert "ConfigMap, JobSet (valid)" in ok.stdout
    (written,) = tmp_path.glob("llama3-70b-trn2-*.yaml")  # named after the dry run's run id
    assert [m["kind"] for m in yaml.safe_load_all(written.read_text())] == ["ConfigMap", "JobSet"]
    cpu = tessera("render", "deployments/specs/local-cpu.yaml", "--out", str(tmp_path))
    assert cpu.returncode == 1 and "cluster.accelerator=cpu runs on this host" in cpu.stderr
    assert "Traceback" not in cpu.stderr


def test_a_chip_without_a_known_node_type_is_refused_naming_it(tmp_path: Path) -> None:
    data = read_yaml((SPEC_DIR / "gpu-llama3-8b-h100.yaml").read_text())
    data["cluster"]["chip"] = "h100-nvl"  # in the planner's catalog, but on no cloud node type we know
    spec = parse_spec(data)
    run = Run.open(spec, RunDir(tmp_path / f"{spec.name}-{RUN_TOKEN}"), data_url=DATA_URL)
    with pytest.raises(
        ManifestError, match=r"cluster.chip=h100-nvl has no known Kubernetes node type.*h100-sxm"
    ):
        render_manifests(run)


def ft_run() -> Run:
    """The 8B GPU spec as HSDP over two one-node replica groups with replica fault tolerance."""
    data = read_yaml((SPEC_DIR / "gpu-llama3-8b-h100.yaml").read_text())
    data["parallel"] |= {"dp_replicate": 2, "dp_shard": 16}
    data["cluster"] |= {"nodes": 4}
    data["faults"] = {"replica_fault_tolerance": True, "max_restarts": 3}
    spec = parse_spec(data)
    return Run.open(spec, RunDir(Path(tempfile.mkdtemp()) / f"{spec.name}-{RUN_TOKEN}"), data_url=DATA_URL)


def test_replica_fault_tolerance_renders_a_job_per_replica_group_restarted_alone_and_a_lighthouse() -> None:
    run = ft_run()
    config_map, jobset = render_manifests(run)
    validate_manifests([config_map, jobset])
    assert crd_errors(jobset) == []
    nodes, lighthouse = jobset["spec"]["replicatedJobs"]
    assert (nodes["name"], nodes["replicas"], lighthouse["name"], lighthouse["replicas"]) == (
        "node",
        2,
        "lighthouse",
        1,
    )
    job = nodes["template"]["spec"]
    assert job["completions"] == job["parallelism"] == 2 and job["backoffLimit"] == 0  # two nodes a group
    container = job["template"]["spec"]["containers"][0]
    args, env = container["args"], {e["name"]: e for e in container["env"]}
    name = run.run_id
    # Each group its own rendezvous, at its own pod 0; every pod learns its group from its Job's index.
    assert f"--rdzv-endpoint={name}-node-$(REPLICA_GROUP_ID)-0.{name}:29400" in args
    assert "--nnodes=2" in args and "--nproc-per-node=8" in args
    assert env["REPLICA_GROUP_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    )
    assert env["TORCHFT_LIGHTHOUSE"]["value"] == f"http://{name}-lighthouse-0-0.{name}:29510"
    # A lost replica group recreates its own Job; a user error still fails the run; success is the
    # training Jobs', since the Lighthouse serves until it is stopped.
    rules = jobset["spec"]["failurePolicy"]["rules"]
    assert [(r["action"], r.get("targetReplicatedJobs")) for r in rules] == [
        ("FailJobSet", None),
        ("RestartJobAndIgnoreMaxRestarts", ["node"]),
        ("RestartJob", ["node"]),
    ]
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}
    # Exclusive placement per replica group's Job (a slice or node group each), none for the Lighthouse.
    assert EXCLUSIVE_TOPOLOGY not in jobset["metadata"].get("annotations", {})
    assert EXCLUSIVE_TOPOLOGY in nodes["template"]["metadata"]["annotations"]
    assert "annotations" not in lighthouse["template"]["metadata"]
    pod = lighthouse["template"]["spec"]["template"]["spec"]
    (serve,) = pod["containers"]
    assert serve["command"][:3] == ["python", "-m", "trainer.runtime.replica_groups"]
    assert serve["readinessProbe"]["httpGet"] == {"path": "/status", "port": 29510}
    assert not any(chip in serve["resources"].get("limits", {}) for chip in CHIP_RESOURCE.values())
    job_json = json.loads(config_map["data"]["job.json"])
    assert job_json["parallel"]["dp_replicate"] == 2 and job_json["faults"]["replica_fault_tolerance"]


def test_a_replica_group_is_whole_nodes() -> None:
    data = read_yaml((SPEC_DIR / "gpu-llama3-8b-h100.yaml").read_text())
    data["train"] |= {"global_batch_size": 48}
    data["parallel"] |= {"dp_replicate": 2, "dp_shard": 8}
    data["cluster"] |= {"nodes": 2}
    data["faults"] = {"replica_fault_tolerance": True}
    assert parse_spec(data).faults.replica_fault_tolerance
    data["parallel"]["dp_shard"], data["cluster"]["nodes"] = 12, 3  # a replica group of 1.5 nodes
    with pytest.raises(
        SpecError, match=r"cluster.nodes \(3\) must be a multiple of parallel.dp_replicate \(2\)"
    ):
        parse_spec(data)

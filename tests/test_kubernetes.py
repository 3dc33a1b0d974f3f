"""Kubernetes rendering for each accelerator spec: schema-valid, pinned by golden files, and the pool
templates, work pools and prefect.yaml consistent with the specs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.kubernetes import (
    CHIP_RESOURCE,
    ManifestError,
    job_name,
    render_manifests,
    tpu_topology,
    validate_manifests,
    write_manifests,
)
from deployments.pools import POOLS, base_job_template
from deployments.register import PREFECT_YAML, REPO_ROOT, render_prefect_yaml
from deployments.spec import SPEC_DIR, load_spec, parse_spec
from tasks.plan import job_for

GOLDEN = Path(__file__).parent / "golden"
ACCELERATOR_SPECS = ["gpu-llama3-8b-h100", "tpu-llama3-70b-v5p", "trainium-llama3-70b-trn2"]
DATA_URL = "s3://bucket/tessera/data/0123456789abcdef/manifest.json"  # fixed: data prep is not run here


def rendered(name: str) -> list[dict]:
    spec = load_spec(SPEC_DIR / f"{name}.yaml")
    return render_manifests(spec, job_for(spec, DATA_URL))


@pytest.mark.parametrize("name", ACCELERATOR_SPECS)
def test_manifests_are_valid_and_match_golden(name: str, tmp_path: Path) -> None:
    manifests = rendered(name)
    validate_manifests(manifests)
    # The ConfigMap's job.json is the spec itself (checked below); the golden pins what rendering decides.
    manifests[0]["data"]["job.json"] = "<job config>"
    text = write_manifests(manifests, tmp_path).read_text()
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"rendering changed; review and rerun with UPDATE_GOLDEN=1 to accept ({golden})"
    )


@pytest.mark.parametrize("name", ACCELERATOR_SPECS)
def test_one_pod_per_node_with_the_nodes_chips_and_a_shared_rendezvous(name: str) -> None:
    spec = load_spec(SPEC_DIR / f"{name}.yaml")
    config_map, service, job = rendered(name)
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == spec.cluster.nodes
    pod = job["spec"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits[CHIP_RESOURCE[spec.cluster.accelerator]] == spec.cluster.chips_per_node
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    args = pod["containers"][0]["args"]
    assert f"--rdzv-endpoint={job_name(spec)}-0.{job_name(spec)}:29400" in args
    assert (
        f"--nnodes={spec.cluster.nodes}" in args and f"--nproc-per-node={spec.cluster.chips_per_node}" in args
    )
    assert yaml.safe_load(config_map["data"]["job.json"])["data_url"] == DATA_URL
    tolerated = {t["key"] for t in pod["tolerations"]}
    assert CHIP_RESOURCE[spec.cluster.accelerator] in tolerated


def test_store_credentials_reach_the_pods_by_secret_name_only() -> None:
    trainer = rendered("gpu-llama3-8b-h100")[2]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["envFrom"] == [{"secretRef": {"name": "tessera-s3"}}]
    assert "envFrom" not in rendered("tpu-llama3-70b-v5p")[2]["spec"]["template"]["spec"]["containers"][0]


def test_accelerator_specific_placement() -> None:
    gpu = rendered("gpu-llama3-8b-h100")[2]["spec"]["template"]["spec"]
    assert gpu["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert gpu["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
    tpu = rendered("tpu-llama3-70b-v5p")[2]["spec"]["template"]["spec"]
    assert tpu["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "4x8x8",
    }  # 64 hosts × 4 chips
    trn = rendered("trainium-llama3-70b-trn2")[2]["spec"]["template"]["spec"]
    assert trn["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn2.48xlarge"
    assert trn["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16


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
    manifests[2]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = [8]
    with pytest.raises(
        ManifestError, match=r"Job tessera-llama3-8b-h100: spec\.template\.spec\.containers\.0\.resources"
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
    assert PREFECT_YAML.read_text() == render_prefect_yaml(), "regenerate it: python -m deployments.register"
    config = yaml.safe_load(PREFECT_YAML.read_text())
    deployments = {(d["entrypoint"].rsplit(":", 1)[1], d["name"]): d for d in config["deployments"]}
    for spec_file in SPEC_DIR.glob("*.yaml"):
        pipeline = deployments[("train_pipeline", spec_file.stem)]
        assert pipeline["work_pool"]["name"] == load_spec(spec_file).cluster.pool
        assert load_spec(spec_file) == parse_spec(pipeline["parameters"]["spec"])
        assert deployments[("evaluate_checkpoints", spec_file.stem)]["schedules"][0]["interval"] > 0
    assert deployments[("train_pipeline", "nightly")]["schedules"][0]["cron"] == "0 3 * * *"


def test_render_command_writes_valid_manifests_and_refuses_cpu_specs(tmp_path: Path) -> None:
    def tessera(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deployments.cli", *args],
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
    assert "ConfigMap, Service, Job (valid)" in ok.stdout
    assert [
        m["kind"] for m in yaml.safe_load_all((tmp_path / "tessera-llama3-70b-trn2.yaml").read_text())
    ] == ["ConfigMap", "Service", "Job"]
    cpu = tessera("render", "deployments/specs/local-cpu.yaml", "--out", str(tmp_path))
    assert cpu.returncode == 1 and "cluster.accelerator=cpu runs on this host" in cpu.stderr
    assert "Traceback" not in cpu.stderr

"""``make k8s-smoke``: the real launcher path against a real cluster (kind, k3s, EKS, GKE), if any.

Skips with a message unless ``KUBECONFIG`` is set. Otherwise it renders the spec's JobSet, applies it
through the same client code the train task uses (the cluster's JobSet webhook and, with
``cluster.queue``, Kueue admit or reject it for real), reads its status until its pods exist or
``--wait-s`` passes, then deletes it and checks that the JobSet, its ConfigMap and its pods are gone.
It does not need the pods to train: on a cluster without the spec's accelerators they stay Pending,
which still proves apply, status, ownership and delete against a real API server and controller.

    KUBECONFIG=~/.kube/config make k8s-smoke CLUSTER_SPEC=deployments/specs/gpu-llama3-8b-h100.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from deployments.kubernetes.client import api_client, apply_manifests, delete_manifests, jobset_status
from deployments.kubernetes.render import render_manifests, validate_manifests
from deployments.run import Run
from deployments.spec import load_spec
from trainer.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.k8s_smoke", description=__doc__)
    parser.add_argument("spec", type=Path, help="An accelerator spec (its checkpoint.url must be a bucket).")
    parser.add_argument("--wait-s", type=float, default=120.0, help="How long to wait for the pods.")
    args = parser.parse_args(argv)
    if not os.environ.get("KUBECONFIG"):
        print("k8s-smoke skipped: KUBECONFIG is not set (point it at a cluster with JobSet installed)")
        return 0
    spec = load_spec(args.spec)
    with tempfile.TemporaryDirectory() as scratch:
        run = Run.open(
            spec, RunDir(Path(scratch) / f"{spec.name}-5e0c0de0"), data_url="s3://unused/manifest.json"
        )
    manifests = render_manifests(run)
    validate_manifests(manifests)
    jobset = manifests[-1]
    name, namespace = jobset["metadata"]["name"], jobset["metadata"]["namespace"]
    selector = f"jobset.sigs.k8s.io/jobset-name={name}"
    core = api_client().CoreV1Api()
    apply_manifests(manifests)
    try:
        deadline = time.monotonic() + args.wait_s
        while not (pods := core.list_namespaced_pod(namespace, label_selector=selector).items):
            if time.monotonic() > deadline:
                print(f"k8s-smoke: no pods of JobSet {name} after {args.wait_s:.0f} s", file=sys.stderr)
                return 1
            time.sleep(2)
        print(f"k8s-smoke: JobSet {name} {jobset_status(jobset).state}, {len(pods)} pod(s) created")
    finally:
        delete_manifests(manifests)
    left = core.list_namespaced_pod(namespace, label_selector=selector).items
    print(
        f"k8s-smoke: deleted; {len(left)} pod(s) left terminating"
        if left
        else "k8s-smoke: deleted, nothing left"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

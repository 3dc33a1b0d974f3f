"""A FAKE Kubernetes API server on 127.0.0.1, for driving tessera's real ``kubernetes`` client code.

No Kubernetes API server can be installed here (tests/PITFALLS: no kube-apiserver, no Docker), so
this is an HTTP fake, not a cluster. It speaks just enough of the REST API for what
``deployments/kubernetes/client.py`` calls through the official ``kubernetes`` Python client, and it says so:

- namespaced create / read / list (label selectors of ``k=v`` pairs) / delete for any resource path,
  ``/api/v1/...`` and ``/apis/<group>/<version>/...``, with uids, 404 and 409 answers as Kubernetes
  gives them, and pod logs;
- POSTed JobSets, LocalQueues, ClusterQueues and ResourceFlavors are checked against the vendored
  CRD schemas (tests/schemas), answering 422 like the API server;
- deleting an object deletes what names it in ``ownerReferences`` (the garbage collector's cascade).

What a controller would do is done by the test through :meth:`FakeCluster.fail_pod`,
:meth:`FakeCluster.finish` and :meth:`FakeCluster.end_job`: a stand-in for the Job and JobSet
controllers that applies the *rendered* pod failure policy and JobSet failure policy as their
documentation specifies (first matching rule, reasons and message patterns, maxRestarts), with the
Job controller's documented failure messages.
It is not the real controllers; ``make k8s-smoke`` runs the same client code against a real cluster.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

from tests.crd_schemas import crd_errors, vendored_kinds

_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_LABEL = "batch.kubernetes.io/job-name"

Obj = dict[str, Any]


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


class FakeCluster:
    """The fake's state: objects by (resource, namespace, name), the requests seen, pod logs."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.requests: list[tuple[str, str]] = []
        self.logs: dict[str, str] = {}
        self.lock = threading.RLock()

    # -- the REST API ----------------------------------------------------------------------------
    def create(self, resource: str, namespace: str, obj: Obj) -> tuple[int, Obj]:
        if (obj["apiVersion"], obj["kind"]) in vendored_kinds() and (errors := crd_errors(obj)):
            return 422, _status(422, "Invalid", f"{obj['kind']} is invalid: {'; '.join(errors)}")
        key = (resource, namespace, obj["metadata"]["name"])
        with self.lock:
            if key in self.objects:
                return 409, _status(409, "AlreadyExists", f"{resource} {key[2]!r} already exists")
            obj = json.loads(json.dumps(obj))
            obj["metadata"].update(uid=str(uuid.uuid4()), namespace=namespace, resourceVersion="1")
            obj["metadata"].setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            self.objects[key] = obj
            if obj["kind"] == "JobSet":
                self._start_pods(obj)
        return 201, obj

    def read(self, resource: str, namespace: str, name: str) -> tuple[int, Obj]:
        with self.lock:
            obj = self.objects.get((resource, namespace, name))
        return (200, obj) if obj else (404, _status(404, "NotFound", f'{resource} "{name}" not found'))

    def list(self, resource: str, namespace: str, selector: str) -> Obj:
        wanted = dict(pair.split("=", 1) for pair in selector.split(",") if pair)
        with self.lock:
            items = [
                o
                for (r, ns, _), o in self.objects.items()
                if r == resource
                and ns == namespace
                and wanted.items() <= (o["metadata"].get("labels") or {}).items()
            ]
        return {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items}

    def delete(self, resource: str, namespace: str, name: str) -> tuple[int, Obj]:
        with self.lock:
            obj = self.objects.pop((resource, namespace, name), None)
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
            self._collect(obj["metadata"]["uid"])
        return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    def _collect(self, owner_uid: str) -> None:
        """The garbage collector: delete every dependent of ``owner_uid``, and theirs."""
        for key, obj in list(self.objects.items()):
            if any(ref["uid"] == owner_uid for ref in obj["metadata"].get("ownerReferences") or []):
                del self.objects[key]
                self._collect(obj["metadata"]["uid"])

    # -- stand-ins for the controllers (see the module docstring) -----------------------------------
    def jobset(self, namespace: str, name: str) -> Obj:
        return self.objects[("jobsets", namespace, name)]

    def pods(self, jobset: Obj) -> list[Obj]:
        return self.list(
            "pods", jobset["metadata"]["namespace"], f"{JOBSET_LABEL}={jobset['metadata']['name']}"
        )["items"]

    def _start_pods(self, jobset: Obj) -> None:
        """What the JobSet and Job controllers create: one running pod per completion index."""
        name, namespace = jobset["metadata"]["name"], jobset["metadata"]["namespace"]
        (replicated,) = jobset["spec"]["replicatedJobs"]
        for index in range(replicated["template"]["spec"]["completions"]):
            pod_name = f"{name}-{replicated['name']}-0-{index}-abcde"
            owner = {
                "apiVersion": jobset["apiVersion"],
                "kind": "JobSet",
                "name": name,
                "uid": jobset["metadata"]["uid"],
            }
            running = {"phase": "Running", "containerStatuses": [_container({"running": {}})]}
            self.objects[("pods", namespace, pod_name)] = _pod(
                pod_name, namespace, {JOBSET_LABEL: name}, owner, running
            )

    def fail_pod(self, namespace: str, name: str, exit_code: int | None, log: str = "") -> str:
        """Pod 0 of the JobSet fails (``exit_code``; None: evicted, condition DisruptionTarget). The Job
        fails as its pod failure policy says, then the JobSet acts as its failure policy says; returns
        the action taken (RestartJobSet, RestartJobSetAndIgnoreMaxRestarts, FailJobSet)."""
        with self.lock:
            jobset = self.jobset(namespace, name)
            pod = self.pods(jobset)[0]
            reason, message = _job_failure(jobset, pod, exit_code)
            action = _jobset_action(jobset, reason, message)
            status = jobset.setdefault("status", {"restarts": 0})
            if (
                action == "RestartJobSet"
                and status["restarts"] >= jobset["spec"]["failurePolicy"]["maxRestarts"]
            ):
                action = "FailJobSet"
            if action == "FailJobSet":
                pod["status"] = {"phase": "Failed", "containerStatuses": [_container(_terminated(exit_code))]}
                self.logs[pod["metadata"]["name"]] = log
                status["conditions"] = [
                    {"type": "Failed", "status": "True", "reason": reason, "message": message}
                ]
            else:  # Recreate: every pod of the gang goes and comes back
                status["restarts"] += 1
                for old in self.pods(jobset):
                    del self.objects[("pods", namespace, old["metadata"]["name"])]
                self._start_pods(jobset)
        return action

    def finish(self, namespace: str, name: str) -> None:
        with self.lock:
            status = self.jobset(namespace, name).setdefault("status", {"restarts": 0})
            status["conditions"] = [{"type": "Completed", "status": "True"}]

    def end_job(self, namespace: str, name: str, exit_code: int, log: str = "") -> None:
        """The Job controller's part for a plain Job (the evaluation Job): its one pod exits with
        ``exit_code``, and the Job is Complete (0) or Failed."""
        with self.lock:
            job = self.objects[("jobs", namespace, name)]
            pod_name = f"{name}-abcde"
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"]}
            ended = {
                "phase": "Failed" if exit_code else "Succeeded",
                "containerStatuses": [_container(_terminated(exit_code))],
            }
            self.objects[("pods", namespace, pod_name)] = _pod(
                pod_name, namespace, {JOB_LABEL: name}, owner, ended
            )
            self.logs[pod_name] = log
            condition = "Failed" if exit_code else "Complete"
            job["status"] = {"conditions": [{"type": condition, "status": "True"}]}


def _pod(name: str, namespace: str, labels: dict[str, str], owner: Obj, status: Obj) -> Obj:
    """A Pod as a controller creates it: labelled, owned (so deleting the owner collects it), with a status."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "labels": labels,
            "ownerReferences": [owner],
        },
        "status": status,
    }


def _container(state: Obj) -> Obj:
    return {
        "name": "trainer",
        "image": "tessera",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": state,
    }


def _terminated(exit_code: int | None) -> Obj:
    return {"terminated": {"exitCode": 137 if exit_code is None else exit_code, "reason": "Error"}}


def _job_failure(jobset: Obj, pod: Obj, exit_code: int | None) -> tuple[str, str]:
    """The Job's failure reason and message under its pod failure policy (the Job controller's wording)."""
    where = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
    rules = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    for index, rule in enumerate(rules):
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return "PodFailurePolicy", (
                f"Container trainer for pod {where} failed with exit code {exit_code} matching "
                f"{rule['action']} rule at index {index}"
            )
        conditions = {c["type"] for c in rule.get("onPodConditions", [])}
        if exit_code is None and "DisruptionTarget" in conditions:
            return "PodFailurePolicy", (
                f"Pod {where} has condition DisruptionTarget matching {rule['action']} rule at index {index}"
            )
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _jobset_action(jobset: Obj, reason: str, message: str) -> str:
    """The first JobSet failure-policy rule whose reasons and message patterns both match; else restart."""
    for rule in jobset["spec"]["failurePolicy"].get("rules", []):
        reasons, patterns = (
            rule.get("onJobFailureReasons") or [],
            rule.get("onJobFailureMessagePatterns") or [],
        )
        if (not reasons or reason in reasons) and (
            not patterns or any(re.search(p, message) for p in patterns)
        ):
            return rule["action"]
    return "RestartJobSet"


def _handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _reply(self, code: int, body: Obj | str) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[re.Match[str] | None, dict[str, list[str]]]:
            url = urlparse(self.path)
            cluster.requests.append((self.command, url.path))
            return _PATH.match(url.path), parse_qs(url.query)

        def do_GET(self) -> None:
            match, query = self._route()
            if not match:
                return self._reply(404, _status(404, "NotFound", self.path))
            resource, ns, name, sub = match["resource"], match["ns"], match["name"], match["sub"]
            if name is None:
                return self._reply(200, cluster.list(resource, ns, query.get("labelSelector", [""])[0]))
            if sub == "log":
                return self._reply(200, cluster.logs.get(name, ""))
            self._reply(*cluster.read(resource, ns, name))

        def do_POST(self) -> None:
            match, _ = self._route()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not match or match["name"]:
                return self._reply(404, _status(404, "NotFound", self.path))
            self._reply(*cluster.create(match["resource"], match["ns"], body))

        def do_DELETE(self) -> None:
            match, _ = self._route()
            length = int(self.headers.get("Content-Length") or 0)
            options = json.loads(self.rfile.read(length)) if length else {}
            cluster.requests[-1] = (
                "DELETE",
                f"{self.path} propagationPolicy={options.get('propagationPolicy')}",
            )
            if not match or not match["name"]:
                return self._reply(404, _status(404, "NotFound", self.path))
            self._reply(*cluster.delete(match["resource"], match["ns"], match["name"]))

    return Handler


@contextmanager
def fake_cluster(kubeconfig: Path) -> Iterator[FakeCluster]:
    """Serve a :class:`FakeCluster` on 127.0.0.1 and write a kubeconfig for it to ``kubeconfig``."""
    cluster = FakeCluster()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(cluster))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                ],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    try:
        yield cluster
    finally:
        server.shutdown()
        server.server_close()

"""Shared pytest setup: object-store servers (tests/stores.py), Prefect servers (tests/prefect_server.py),
the session's fork server (tests/warm_workers.py) and the fake Kubernetes API server (tests/k8s_fake.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.k8s_fake import FakeCluster, fake_cluster

pytest_plugins = ["tests.stores", "tests.prefect_server", "tests.warm_workers"]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCluster]:
    """An HTTP fake Kubernetes API server (tests/k8s_fake.py), reached through a kubeconfig."""
    kubeconfig = tmp_path / "kubeconfig"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: use the kubeconfig
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    with fake_cluster(kubeconfig) as fake:
        yield fake

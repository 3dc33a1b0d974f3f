"""Register tessera with a Prefect server: work pools, and deployments from ``prefect.yaml``.

It names the flows' entry points, so it sits in the top layer with the CLI, above ``flows/``.

``prefect.yaml`` at the repo root is generated from the spec files (one source of truth: the
specs) by :func:`prefect_yaml` and checked in, so ``prefect deploy --all`` works from the repo root;
a test keeps the two in sync. ``tessera deploy`` = create/update the pools, regenerate, deploy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import prefect
import yaml
from prefect import get_client
from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectAlreadyExists
from prefect.settings import PREFECT_API_URL

from deployments.pools import ORCHESTRATOR_POD, POOLS, base_job_template
from deployments.spec import SPEC_DIR, load_spec, read_yaml
from trainer.failures import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO_ROOT / "prefect.yaml"
PIPELINE = "flows/pipeline.py:train_pipeline"
EVALUATE = "flows/pipeline.py:evaluate_checkpoints"
IMAGE_WORKDIR = "/opt/tessera"  # where the container images hold this repo
NIGHTLY_SPEC = "local-cpu"
EVAL_INTERVAL_S = 1800  # catch-up evaluation; the pipeline itself evaluates while training


class NoServer(RuntimeError):
    """No Prefect server configured: pools and deployments would land in a throwaway temporary server."""


def require_server() -> str:
    url = PREFECT_API_URL.value()
    if not url:
        raise NoServer(
            "PREFECT_API_URL is not set; start a server (`make ui`, or `prefect server start`) and "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    return url


def ensure_pools() -> list[str]:
    """Create each tessera work pool, or update its description and base job template; return the names."""
    require_server()
    with get_client(sync_client=True) as client:
        for pool in POOLS.values():
            template = base_job_template(pool.accelerator)
            try:
                client.create_work_pool(
                    WorkPoolCreate(
                        name=pool.name,
                        type=pool.type,
                        description=pool.description,
                        base_job_template=template,
                    )
                )
            except ObjectAlreadyExists:
                client.update_work_pool(
                    pool.name, WorkPoolUpdate(description=pool.description, base_job_template=template)
                )
    return [pool.name for pool in POOLS.values()]


def _deployment(
    name: str, entrypoint: str, spec_file: Path, description: str, **extra: Any
) -> dict[str, Any]:
    spec = load_spec(spec_file)  # a broken spec file fails generation, not a scheduled run
    pool: dict[str, Any] = {"name": spec.cluster.pool}
    body: dict[str, Any] = {
        "name": name,
        "entrypoint": entrypoint,
        "description": description,
        "tags": ["tessera", spec.cluster.accelerator],
    }
    if spec.cluster.accelerator != "cpu":
        pool["job_variables"] = {
            "image": spec.cluster.image,
            "namespace": spec.cluster.namespace,
            **ORCHESTRATOR_POD,
        }
        body["pull"] = [{"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_WORKDIR}}]
    return {**body, "parameters": {"spec": read_yaml(spec_file.read_text())}, "work_pool": pool, **extra}


def prefect_yaml(spec_dir: Path = SPEC_DIR) -> dict[str, Any]:
    """The whole ``prefect.yaml``: per spec file, the pipeline and scheduled catch-up evaluation; plus nightly."""
    deployments = []
    for spec_file in sorted(spec_dir.glob("*.yaml")):
        local = load_spec(spec_file).cluster.accelerator == "cpu"
        deployments.append(
            _deployment(spec_file.stem, PIPELINE, spec_file, f"Train {spec_file.name} end to end.")
        )
        deployments.append(
            _deployment(
                spec_file.stem,
                EVALUATE,
                spec_file,
                f"Validate and evaluate new checkpoints of {spec_file.name}.",
                schedules=[{"interval": EVAL_INTERVAL_S, "active": local}],
            )
        )
    deployments.append(
        _deployment(
            "nightly",
            PIPELINE,
            spec_dir / f"{NIGHTLY_SPEC}.yaml",
            "Nightly small-model run: the whole pipeline on CPU.",
            schedules=[{"cron": "0 3 * * *", "timezone": "UTC", "active": True}],
        )
    )
    return {
        "name": "tessera",
        "prefect-version": prefect.__version__,
        "build": None,
        "push": None,
        "deployments": deployments,
    }


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated values out in full: no &anchors/*aliases in a file people read."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_prefect_yaml(spec_dir: Path = SPEC_DIR) -> str:
    header = "# Generated from deployments/specs/*.yaml by `python -m tessera.register`: edit the specs, not this.\n"
    return header + yaml.dump(prefect_yaml(spec_dir), Dumper=_PlainDumper, sort_keys=False, width=110)


def checkout(start: Path | None = None) -> Path:
    """The tessera checkout ``tessera deploy`` deploys: the nearest directory at or above ``start`` (the
    working directory) with a prefect.yaml and deployments/specs/, so it deploys the code you are in,
    not an installed package's copy."""
    here = (start or Path.cwd()).resolve()
    for path in (here, *here.parents):
        if (path / "prefect.yaml").is_file() and (path / "deployments" / "specs").is_dir():
            return path
    raise UserError(
        f"no tessera checkout at or above {here} (a directory with prefect.yaml and deployments/specs/); "
        "run tessera deploy inside your clone"
    )


def deploy_all(names: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    """``prefect deploy`` from the checkout ``root`` (every deployment, or the given flow/deployment
    names); its exit code."""
    selection = ["--all"] if not names else [arg for name in names for arg in ("--name", name)]
    return subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", *selection], cwd=root
    ).returncode


def seal_parameters() -> list[str]:
    """Make every tessera deployment's parameter schema refuse unknown top-level parameters.

    Prefect builds the schema from the flow's signature without ``additionalProperties: false``, so a
    misspelt top-level parameter passes the server and then crashes the flow run in the worker
    ("Process exited with status code: 1", the cause in the worker's log alone). Sealed, the server
    refuses it when the run is created, naming the parameter. Returns the deployments sealed.
    """
    entrypoints = {d["entrypoint"] for d in prefect_yaml()["deployments"]}
    sealed = []
    with get_client(sync_client=True) as client:
        for deployment in client.read_deployments():
            if deployment.entrypoint not in entrypoints:
                continue
            schema = {**deployment.parameter_openapi_schema, "additionalProperties": False}
            client.update_deployment(deployment.id, DeploymentUpdate(parameter_openapi_schema=schema))
            sealed.append(deployment.name)
    return sealed


if __name__ == "__main__":
    PREFECT_YAML.write_text(render_prefect_yaml())

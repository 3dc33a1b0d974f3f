"""``tessera``: the command line over specs, planner, trainer, pipeline and deployments.

User errors (a bad spec, a missing file) print one readable line and exit 1; tracebacks are for bugs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from deployments.spec import SpecError, TrainingSpec, load_spec

app = typer.Typer(
    help="Train large transformers across many accelerators, driven by declarative Prefect workflows.\n\n"
    "Examples:\n\n"
    "  tessera validate deployments/specs/local-cpu.yaml\n\n"
    "  tessera plan deployments/specs/gpu-llama3-8b-h100.yaml --search\n\n"
    "  tessera run deployments/specs/local-cpu.yaml\n\n"
    "  tessera render deployments/specs/tpu-llama3-70b-v5p.yaml --out build/manifests\n\n"
    "Run `tessera COMMAND --help` for each command's options and an example.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SpecPath = Annotated[Path, typer.Argument(help="Spec YAML file, e.g. deployments/specs/local-cpu.yaml.")]
F = TypeVar("F", bound=Callable[..., object])


class UserError(Exception):
    """An error whose message is the whole story: shown without a traceback."""


def user_errors(fn: F) -> F:
    """Turn user errors into one line on stderr and exit code 1."""

    @wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except (SpecError, UserError, FileNotFoundError) as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@user_errors
def validate(spec: SpecPath) -> None:
    """Check a spec: types, cross-field layout rules and chip catalog; exit 1 with the field and fix.

    Example: tessera validate deployments/specs/local-cpu.yaml
    """
    loaded = load_spec(spec)
    typer.echo(
        f"ok: {loaded.name}: {loaded.model.preset} on {loaded.cluster.nodes}×{loaded.cluster.chips_per_node} "
        f"{loaded.cluster.chip} (dp_replicate={loaded.parallel.dp_replicate} dp_shard={loaded.parallel.dp_shard} "
        f"tp={loaded.parallel.tp} pp={loaded.parallel.pp}), pool {loaded.cluster.pool}"
    )


@app.command()
@user_errors
def plan(
    spec: SpecPath,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable JSON instead of tables.")] = False,
    search: Annotated[
        bool, typer.Option("--search", help="Also rank every layout that fits by step time.")
    ] = False,
    top: Annotated[int, typer.Option(help="Layouts to show with --search.")] = 10,
    chart: Annotated[
        Path | None,
        typer.Option(help="Also draw the per-chip memory breakdown vs HBM as a PNG at this path."),
    ] = None,
) -> None:
    """Estimate memory per chip, FLOPs, communication, step time, MFU and checkpoint cadence for SPEC.

    Example: tessera plan deployments/specs/gpu-llama3-8b-h100.yaml --search --chart memory.png
    """
    from rich.console import Console

    from trainer.plan import format_plan, format_search, make_plan, search_layouts

    loaded = load_spec(
        spec, overrides={"allow_oversubscribe": True}
    )  # show the plan even when it does not fit
    inputs = (loaded.model, loaded.parallel, loaded.train, loaded.cluster, loaded.checkpoint)
    estimate = make_plan(*inputs)
    if chart is not None:
        from trainer.plan.chart import plot_memory_breakdown

        typer.echo(f"memory chart: {plot_memory_breakdown(estimate, chart)}", err=True)
    ranked = search_layouts(*inputs, top=top) if search else []
    if as_json:
        payload = estimate.model_dump(mode="json")
        if search:
            payload["search"] = [candidate.model_dump(mode="json") for candidate in ranked]
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    console.print(format_plan(estimate))
    if search:
        console.print(format_search(ranked) if ranked else "no layout of this chip count fits")


@app.command()
@user_errors
def train(
    spec: SpecPath,
    run_dir: Annotated[
        Path, typer.Option(help="Run directory: job.json, metrics.jsonl, checkpoints; reuse it to resume.")
    ],
    nproc: Annotated[
        int | None, typer.Option(help="Processes on this host (default: the spec's world size).")
    ] = None,
    data: Annotated[
        str | None, typer.Option(help="Prepared dataset manifest URL (default: synthetic tokens).")
    ] = None,
) -> None:
    """Train SPEC under torchrun on this host; exits with the trainer's code (0 ok, 3 user error, 4 hang).

    Example: tessera train deployments/specs/local-cpu.yaml --run-dir runs/manual
    """
    from trainer.failures import UserError as TrainerUserError
    from trainer.launch import run_local
    from trainer.progress import StepProgress

    loaded = load_spec(spec)
    try:
        with StepProgress(run_dir / "metrics.jsonl", loaded.train.steps):
            result = run_local(loaded.job_config(data_url=data), run_dir, nproc)
    except TrainerUserError as exc:
        raise UserError(str(exc)) from None
    if result.kind != "ok":
        typer.secho(
            f"training failed: {result.kind.replace('_', ' ')} (worker exit code {result.worker_exit_code})",
            fg=typer.colors.RED,
            err=True,
        )
    code = result.worker_exit_code
    raise typer.Exit(code if code >= 0 else 128 - code)  # killed by signal N → 128+N, as a shell reports it


@app.command()
def schema() -> None:
    """Print the spec's JSON schema: what the Prefect UI renders as the run form.

    Example: tessera schema > spec.schema.json
    """
    typer.echo(json.dumps(TrainingSpec.model_json_schema(), indent=2))


@app.command()
@user_errors
def run(spec: SpecPath) -> None:
    """Run the whole pipeline in this process (Prefect's local server, no account); print where results are.

    Shows progress bars (tokenize, shard, training steps) in a terminal; none under CI or in logs.

    Example: tessera run deployments/specs/local-cpu.yaml
    """
    # A busy laptop can take longer than Prefect's 20 s default to start the temporary server.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.pipeline import train_pipeline
    from tasks.paths import run_dir
    from trainer.progress import StepProgress

    loaded = load_spec(spec)
    directory = run_dir(loaded)
    with StepProgress(directory / "metrics.jsonl", loaded.train.steps):
        final = train_pipeline(loaded)
    typer.echo(
        f"\nfinal checkpoint: {final}\nrun dir:          {directory}  (metrics.jsonl, loss.png, evals/, "
        f"report.md)\nartifacts:        prefect artifact ls  (keys {loaded.name}-plan, -progress, -eval, "
        "-loss-curve, -report)"
    )


@app.command()
@user_errors
def render(
    spec: SpecPath,
    out: Annotated[Path, typer.Option(help="Directory for the manifests YAML.")] = Path("build/manifests"),
    data_url: Annotated[
        str | None,
        typer.Option(
            help="Prepared dataset manifest URL for the job (the pipeline fills it after prepare-data)."
        ),
    ] = None,
) -> None:
    """Dry run of provisioning: render SPEC's Kubernetes training job, validate it, write it; apply nothing.

    Example: tessera render deployments/specs/gpu-llama3-8b-h100.yaml --out build/manifests
    """
    from deployments.kubernetes import ManifestError, render_manifests, validate_manifests, write_manifests
    from tasks.plan import job_for

    loaded = load_spec(spec)
    if loaded.cluster.accelerator == "cpu":
        raise UserError(
            f"{spec}: cluster.accelerator=cpu runs on this host; render a gpu, tpu or trainium spec"
        )
    manifests = render_manifests(loaded, job_for(loaded, data_url))
    try:
        validate_manifests(manifests)
    except ManifestError as exc:
        raise UserError(str(exc)) from None
    typer.echo(f"{write_manifests(manifests, out)}: {', '.join(m['kind'] for m in manifests)} (valid)")


@app.command()
@user_errors
def pools() -> None:
    """Create or update the tessera work pools (cpu: process; gpu/tpu/trainium: kubernetes) on PREFECT_API_URL.

    Example: PREFECT_API_URL=http://127.0.0.1:4200/api tessera pools
    """
    from deployments.register import NoServer, ensure_pools

    try:
        names = ensure_pools()
    except NoServer as exc:
        raise UserError(str(exc)) from None
    for name in names:
        typer.echo(f"work pool {name}: ok")


@app.command()
@user_errors
def deploy(
    write: Annotated[bool, typer.Option(help="Regenerate prefect.yaml from the specs first.")] = True,
    name: Annotated[
        list[str] | None, typer.Option(help="Only these deployments (flow-name/deployment).")
    ] = None,
) -> None:
    """Create the work pools and deploy prefect.yaml (every spec's pipeline, catch-up evaluation, nightly run).

    Example: PREFECT_API_URL=http://127.0.0.1:4200/api tessera deploy
    """
    from deployments.register import PREFECT_YAML, NoServer, deploy_all, ensure_pools, render_prefect_yaml

    try:
        ensure_pools()
    except NoServer as exc:
        raise UserError(str(exc)) from None
    if write:
        PREFECT_YAML.write_text(render_prefect_yaml())
    if deploy_all(name):
        raise UserError("prefect deploy failed; its output above names the deployment and the problem")


if __name__ == "__main__":
    app()

"""``tessera``: the command line over specs, planner, trainer, pipeline and deployments.

User errors (a bad spec, a missing file) print one readable line and exit 1; tracebacks are for bugs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from deployments.spec import SpecError, TrainingSpec, load_spec

app = typer.Typer(
    help="Train large transformers across many accelerators, driven by declarative Prefect workflows.\n\n"
    "Examples:\n\n  tessera validate deployments/specs/local-cpu.yaml\n\n"
    "  tessera plan deployments/specs/gpu-llama3-8b-h100.yaml --search\n\n"
    "  tessera run deployments/specs/local-cpu.yaml",
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
    """Check a spec: types, cross-field layout rules and chip catalog; exit 1 with the field and fix."""
    loaded = load_spec(spec)
    typer.echo(
        f"ok: {loaded.name}: {loaded.model.preset} on {loaded.cluster.nodes}×{loaded.cluster.chips_per_node} "
        f"{loaded.cluster.chip} (dp_replicate={loaded.parallel.dp_replicate} dp_shard={loaded.parallel.dp_shard} "
        f"tp={loaded.parallel.tp} pp={loaded.parallel.pp}), pool {loaded.cluster.pool}"
    )


@app.command()
def schema() -> None:
    """Print the spec's JSON schema: what the Prefect UI renders as the run form."""
    typer.echo(json.dumps(TrainingSpec.model_json_schema(), indent=2))


if __name__ == "__main__":
    app()

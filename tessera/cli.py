"""``tessera``: the command line over specs, planner, trainer, pipeline and deployments.

User errors (a bad spec, a missing file) print one readable line and exit 1; tracebacks are for bugs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from deployments.spec import SpecError, TrainingSpec, load_spec
from trainer.data.errors import DataError
from trainer.failures import UserError

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


# Failures whose message names the input and the fix: the message is the whole report.
USER_ERRORS = (SpecError, UserError, DataError, FileNotFoundError)


def user_errors(fn: F) -> F:
    """Turn user errors into one line on stderr and exit code 1."""

    @wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
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
    model = (
        loaded.model.preset
        if loaded.model.from_hf is None
        else f"{loaded.model.from_hf} ({loaded.model.preset})"
    )
    typer.echo(
        f"ok: {loaded.name}: {model} on {loaded.cluster.nodes}×{loaded.cluster.chips_per_node} "
        f"{loaded.cluster.chip} (dp_replicate={loaded.parallel.dp_replicate} dp_shard={loaded.parallel.dp_shard} "
        f"cp={loaded.parallel.cp} tp={loaded.parallel.tp} pp={loaded.parallel.pp}), pool {loaded.cluster.pool}"
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
    profile: Annotated[
        Path | None,
        typer.Option(help="Chip profile from `tessera calibrate` to use instead of the catalog's figures."),
    ] = None,
) -> None:
    """Estimate memory per chip, FLOPs, communication, step time, MFU and checkpoint cadence for SPEC.

    Example: tessera plan deployments/specs/gpu-llama3-8b-h100.yaml --search --chart memory.png
    """
    from rich.console import Console

    from trainer.backends.chips import get_chip
    from trainer.plan import format_plan, format_search, make_plan, search_layouts
    from trainer.plan.profile import load_profile

    loaded = load_spec(
        spec, overrides={"allow_oversubscribe": True}
    )  # show the plan even when it does not fit
    inputs = (loaded.model, loaded.parallel, loaded.train, loaded.cluster, loaded.checkpoint)
    try:
        figures = load_profile(get_chip(loaded.cluster.chip), profile)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    estimate = make_plan(*inputs, profile=figures, optimizer=loaded.optimizer.name)
    if chart is not None:
        from trainer.report.plan_chart import plot_memory_breakdown

        typer.echo(f"memory chart: {plot_memory_breakdown(estimate, chart)}", err=True)
    ranked = search_layouts(*inputs, top=top, profile=figures) if search else []
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
def goodput(
    spec: SpecPath,
    days: Annotated[float, typer.Option(min=0.01, help="Wall-clock length of the simulated run.")] = 54.0,
    seed: Annotated[int, typer.Option(help="Seed of the failure draws (same seed, same failures).")] = 0,
    plot: Annotated[Path | None, typer.Option(help="Also draw progress and badput as a PNG here.")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Machine-readable JSON instead of a table.")
    ] = False,
) -> None:
    """Simulate SPEC's cluster over a long run with Llama 3's failure rates (Table 5 categories), with
    in-memory + storage checkpoints and with today's restart-all-from-storage, on the same failures.

    Example: tessera goodput benchmarks/llama3-405b-h100-16k.yaml --days 54 --plot goodput.png
    """
    from trainer.plan.goodput_sim import LLAMA3_TABLE5, compare_policies, format_results, policy_clusters

    loaded = load_spec(spec)
    clusters = policy_clusters(
        loaded.model, loaded.parallel, loaded.train, loaded.cluster, loaded.checkpoint, loaded.faults
    )
    results = compare_policies(clusters, LLAMA3_TABLE5, seed, days * 86400)
    if plot is not None:
        from trainer.report.goodput_chart import plot_goodput

        title = f"{loaded.name}: {days:g} days on {loaded.cluster.world_size} × {loaded.cluster.chip}, seed {seed}"
        typer.echo(f"goodput chart: {plot_goodput(results, title, plot)}", err=True)
    if as_json:
        typer.echo(json.dumps({name: r.as_dict() for name, r in results.items()}, indent=2))
        return
    typer.echo(f"failure model: {LLAMA3_TABLE5.name}")
    typer.echo(format_results(results))


@app.command()
@user_errors
def calibrate(
    out: Annotated[Path, typer.Option(help="Where to write the chip profile (JSON).")] = Path(
        "runs/calibration/cpu.json"
    ),
    processes: Annotated[
        int, typer.Option(help="Largest process group whose collectives are measured (2, 4, ...).")
    ] = 4,
    accelerator: Annotated[
        str | None,
        typer.Option(help="cpu, gpu, tpu or trainium (default: gpu where CUDA sees one, else cpu)."),
    ] = None,
    chip: Annotated[
        str | None,
        typer.Option(help="The catalog's chip, where the device's name does not say it (TPU, Trainium)."),
    ] = None,
    checkpoint_dir: Annotated[
        Path, typer.Option(help="Directory whose disk's write speed the plan prices checkpoints at.")
    ] = Path("runs"),
) -> None:
    """Measure this machine's device and write a chip profile for `tessera plan --profile`.

    On a GPU, timed by CUDA events: GEMM throughput over shapes (bf16, fp32, fp8 where the GPU has
    it), HBM bandwidth (a device-to-device copy), fused attention, a real block's matmul and
    element-wise rates, launch overhead, and NCCL's collective α/β over 2, 4, 8 GPUs. On CPU, per
    process with one thread: the same figures, FSDP's round trip on one process, and per process-group
    size (gloo) collective α/β, compute and memory shares, FSDP and TP block round trips. Both: the
    checkpoint directory's raw write speed. The profile names the catalog's chip from the device's
    name, or says which name it did not recognise (then pass --chip).

    Example: tessera calibrate --out runs/calibration/h200.json
    """
    import torch

    from trainer.backends import get_backend
    from trainer.plan.calibrate import calibrate as measure

    name = accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
    try:
        backend = get_backend(name)
        if chip is not None:
            backend.chip(chip)  # an unknown chip, or one of another accelerator, fails here
    except ValueError as exc:
        raise UserError(str(exc)) from None
    backend.require()
    profile = measure(out, processes, backend.device(0), chip, checkpoint_dir=checkpoint_dir)
    if "unrecognised_device" in profile:
        typer.secho(
            f"the chip catalog has no {profile['unrecognised_device']!r}: the profile's chip is "
            f"{profile['chip']!r}; rerun with --chip NAME if it is one of the catalog's",
            err=True,
        )
    typer.echo(f"chip profile: {out} (chip {profile['chip']})")


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
        str | None,
        typer.Option(help="Prepared dataset's card URL (its manifest.json; default: synthetic tokens)."),
    ] = None,
) -> None:
    """Train SPEC under torchrun on this host; exits with the trainer's code (0 ok, 3 user error in
    training, 4 hang), 1 when it refuses to start (invalid spec, checkpoint location is in use or
    unwritable), 128+N when stopped by signal N.

    Example: tessera train deployments/specs/local-cpu.yaml --run-dir runs/manual
    """
    from deployments.run import Run
    from tessera.progress import StepProgress
    from trainer.data.loader import data_cards
    from trainer.rundir import RunDir
    from trainer.runtime.launch import Stopped, stop_on_signals

    loaded = load_spec(spec)
    if nproc is not None and nproc != loaded.parallel.world_size:
        raise UserError(
            f"--nproc {nproc} does not match the spec's world size {loaded.parallel.world_size} "
            f"(dp_replicate×dp_shard×cp×tp×pp); pass --nproc {loaded.parallel.world_size} or change "
            "parallel/cluster in the spec"
        )
    if data is not None:
        data_cards(data)  # a missing dataset: one line here, not a failure in every rank after launch
    run = Run.open(loaded, RunDir(run_dir), data_url=data, on_this_host=True)
    try:
        with stop_on_signals(), run.claim(), StepProgress(lambda: run.dir.metrics, loaded.train.steps):
            if data is None:
                typer.secho(
                    "no --data: training on synthetic tokens (give a prepared manifest URL)", err=True
                )
            result = run.launch_local(echo=sys.stdout.write)
    except Stopped as stop:  # the agents and their ranks are stopped, the lease released: not an error
        typer.secho(f"{stop}; training stopped, resume with the same --run-dir", err=True)
        raise typer.Exit(128 + stop.signum) from None
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


def without_user_error_tracebacks(record: logging.LogRecord) -> bool:
    """Prefect logs a failed task's and flow's exception with its traceback; a user error's one-line
    message (also in the state and in our final line) is all there is to say."""
    if record.exc_info and isinstance(record.exc_info[1], USER_ERRORS):
        record.exc_info, record.exc_text = None, None
    return True


@app.command()
@user_errors
def run(spec: SpecPath) -> None:
    """Run the whole pipeline in this process (Prefect's local server, no account); print where results are.

    Shows progress bars (tokenize, shard, training steps) in a terminal; none under CI or in logs.

    Example: tessera run deployments/specs/local-cpu.yaml
    """
    loaded = load_spec(spec)  # first: a spec error is reported before Prefect is even imported
    # A busy laptop can take longer than Prefect's 20 s default to start the temporary server; its
    # analytics service only fills the terminal with "database is locked" from the temporary SQLite.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from deployments.run import Run
    from flows.pipeline import train_pipeline
    from tessera.progress import StepProgress
    from trainer.runtime.launch import Stopped, stop_on_signals

    started = time.time()
    for runs in ("prefect.flow_runs", "prefect.task_runs"):  # the loggers the run engines log failures to
        logging.getLogger(runs).addFilter(without_user_error_tracebacks)

    def this_run() -> Path | None:
        """The live progress bar's run: the one the flow opens, whose id the flow run has not told yet
        (the newest of the spec since this command began). The final lines name the run the flow returns."""
        runs = [r for r in Run.of_spec(loaded.name) if r.record.stat().st_mtime >= started]
        return runs[-1].metrics if runs else None

    try:
        with stop_on_signals(), StepProgress(this_run, loaded.train.steps):
            trained = train_pipeline(loaded)
    except Stopped as stop:  # the flow's tear-down stopped the agents; Prefect's server stops at exit
        typer.secho(f"{stop}; the run stopped, its checkpoints are kept", err=True)
        raise typer.Exit(128 + stop.signum) from None
    typer.echo(
        f"\nfinal checkpoint: {trained.final_checkpoint_url}\nrun dir:          {trained.run_dir}  "
        f"(metrics.jsonl, loss.png, evals/, report.md)\nartifacts:        prefect artifact ls  (keys "
        f"{trained.run_id}-plan, -progress, -eval, -loss-curve, -report, -comparison)"
    )


@app.command()
@user_errors
def submit(
    deployment: Annotated[str, typer.Argument(help="FLOW/DEPLOYMENT, e.g. train-pipeline/local-cpu.")],
    assignments: Annotated[
        list[str] | None,
        typer.Option("--set", help="FIELD=VALUE to change in the deployment's spec; repeat it."),
    ] = None,
) -> None:
    """Run a deployment with a few spec fields changed: merged into the deployment's own spec,
    validated here (errors name the field), then created as a flow run on PREFECT_API_URL.

    Example: tessera submit train-pipeline/local-cpu --set train.steps=30 --set optimizer.lr=1e-3
    """
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from deployments.spec import apply_overrides, parse_spec
    from tessera.register import NoServer, require_server

    try:
        require_server()
    except NoServer as exc:
        raise UserError(str(exc)) from None
    with get_client(sync_client=True) as client:
        try:
            target = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise UserError(f"no deployment {deployment!r}; `prefect deployment ls` lists them") from None
        spec = parse_spec(
            apply_overrides(target.parameters["spec"], assignments or []), f"{deployment} --set"
        )
        run = client.create_flow_run_from_deployment(
            target.id, parameters={"spec": spec.model_dump(mode="json")}
        )
    typer.echo(f"flow run {run.name} ({run.id}) of {deployment} created; `prefect flow-run inspect {run.id}`")


@app.command()
@user_errors
def compare(
    runs: Annotated[
        list[str],
        typer.Argument(
            help="Two or more runs: run ids (directories under runs/), flow run names (train-<run id>) "
            "or run directories."
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Directory for comparison.png and comparison.md (default: runs/comparisons/A-vs-B)."
        ),
    ] = None,
) -> None:
    """Compare runs: loss curves overlaid (PNG), outcomes and throughput, and the spec diff (markdown).

    Example: tessera compare tiny-local-3f2a9c1b tiny-local-7d01e4aa
    """
    from deployments.run import find_run
    from tasks.compare import write_comparison
    from trainer.report.compare import RunRecord
    from trainer.rundir import runs_root

    if len(runs) < 2:
        raise UserError("give two or more runs to compare, e.g. tessera compare RUN_A RUN_B")
    records = [RunRecord.read(find_run(ref)) for ref in runs]
    png, markdown = write_comparison(
        records, out or runs_root() / "comparisons" / "-vs-".join(r.run_id for r in records)
    )
    typer.echo(markdown.read_text())
    typer.echo(f"loss curves: {png}\ncomparison:  {markdown}")


CheckpointUrl = Annotated[
    str, typer.Argument(help="A checkpoint step directory, or a checkpoint.url (its newest good step).")
]
HFDir = Annotated[Path, typer.Argument(help="A Hugging Face model directory (safetensors + config.json).")]
ModelSpec = Annotated[Path, typer.Option(help="The spec whose model the checkpoint holds.")]


def recorded_spec(checkpoint: str) -> TrainingSpec:
    """The spec in ``run.json`` of the run directory that holds ``checkpoint`` (``<run>/checkpoints``,
    or one of its ``step-N`` directories)."""
    path = Path(checkpoint).resolve()
    for run_dir in (path.parent, path.parent.parent):
        if (record := run_dir / "run.json").is_file():
            return TrainingSpec.model_validate(json.loads(record.read_text())["spec"])
    raise UserError(
        f"no run.json in the run directory around {checkpoint}; pass --spec with the spec it was trained with"
    )


@app.command("export")
@user_errors
def export_checkpoint(
    checkpoint: CheckpointUrl,
    out_dir: HFDir,
    spec: Annotated[
        Path | None,
        typer.Option(
            help="The spec whose model the checkpoint holds (default: its run directory's run.json)."
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bf16 (what the Hub ships) or fp32 (exact).")] = "bf16",
) -> None:
    """Export a checkpoint's weights as Hugging Face Llama (MoE: Mixtral; Qwen2, Qwen3) safetensors + config.json.

    Example: tessera export runs/<run>/checkpoints build/hf
    """
    from trainer.checkpoint import CheckpointError
    from trainer.checkpoint.errors import CheckpointMismatch
    from trainer.checkpoint.hf import DTYPES, export_hf

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    loaded = recorded_spec(checkpoint) if spec is None else load_spec(spec)
    try:
        out = export_hf(checkpoint, loaded.job_config(data_url=None), out_dir, dtype)  # type: ignore[arg-type]
    except CheckpointMismatch:
        raise UserError(
            f"{checkpoint} holds another model than {spec or 'run.json'} describes; export it with the spec "
            "it was trained with (leave out --spec to read its run directory's run.json)"
        ) from None
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    typer.echo(f"exported: {out}")


@app.command("import")
@user_errors
def import_checkpoint(
    hf_dir: HFDir,
    checkpoint_url: Annotated[str, typer.Argument(help="Where to write it (its step-000000 directory).")],
    spec: ModelSpec,
) -> None:
    """Import Hugging Face Llama, Mistral, Mixtral, Qwen2 or Qwen3 safetensors as a tessera checkpoint (weights
    only) for the spec's model (model.from_hf: the HF directory's config.json builds it); training starts from it.

    Example: tessera import build/hf runs/imported/checkpoints --spec deployments/specs/local-cpu.yaml
    """
    from trainer.checkpoint import CheckpointError
    from trainer.checkpoint.hf import import_hf

    try:
        step_url = import_hf(hf_dir, load_spec(spec).job_config(data_url=None), checkpoint_url)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    typer.echo(f"imported: {step_url}")


@app.command()
@user_errors
def render(
    spec: SpecPath,
    out: Annotated[Path, typer.Option(help="Directory for the manifests YAML.")] = Path("build/manifests"),
    data_url: Annotated[
        str | None,
        typer.Option(
            help="Prepared dataset's card URL (its manifest.json) for the job (the pipeline fills it after prepare-data)."
        ),
    ] = None,
) -> None:
    """Dry run of provisioning: render SPEC's Kubernetes training job, validate it, write it; apply nothing.

    Example: tessera render deployments/specs/gpu-llama3-8b-h100.yaml --out build/manifests
    """
    from deployments.kubernetes.render import (
        ManifestError,
        render_manifests,
        validate_manifests,
        write_manifests,
    )
    from deployments.run import Run, new_run_id
    from trainer.rundir import RunDir

    loaded = load_spec(spec)
    if loaded.cluster.accelerator == "cpu":
        raise UserError(
            f"{spec}: cluster.accelerator=cpu runs on this host; render a gpu, tpu or trainium spec"
        )
    with tempfile.TemporaryDirectory() as scratch:  # a dry run: its run directory is thrown away
        run = Run.open(loaded, RunDir(Path(scratch) / new_run_id(loaded.name)), data_url=data_url)
    manifests = render_manifests(run)
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
    from tessera.register import NoServer, ensure_pools

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
    from tessera.register import (
        NoServer,
        checkout,
        deploy_all,
        ensure_pools,
        render_prefect_yaml,
        seal_parameters,
    )

    root = checkout()  # the clone you are in, not the installed package's directory
    try:
        ensure_pools()
    except NoServer as exc:
        raise UserError(str(exc)) from None
    if write:
        (root / "prefect.yaml").write_text(render_prefect_yaml(root / "deployments" / "specs"))
    if deploy_all(name, root):
        raise UserError("prefect deploy failed; its output above names the deployment and the problem")
    seal_parameters()  # unknown top-level parameters are refused by the server, not crashed on by a worker


if __name__ == "__main__":
    app()

"""The typed deployment spec: one tree that is the CLI input, the Prefect flow parameter and the UI form.

``TrainingSpec`` composes the trainer's own configs (``trainer/config.py``) with cluster, data-prep
and eval settings, and validates everything that can be known before launch — including whether
the plan fits in HBM — so a bad spec fails with the field and the fix, never on the cluster.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from trainer.backends.chips import CHIPS, chips_for
from trainer.config import (
    CheckpointConfig,
    DataConfig,
    FaultsConfig,
    HardwareConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    Strict,
    TrainConfig,
    layout_errors,
)
from trainer.plan import fit_error

SPEC_DIR = Path(__file__).parent / "specs"
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?$"  # a valid Kubernetes name, so job names derive from it


class ClusterSpec(HardwareConfig):
    """Where the job runs: hardware plus the Prefect work pool and container image."""

    work_pool: str | None = Field(None, description="Prefect work pool; default tessera-<accelerator>.")
    image: str = Field(
        "tessera:latest", description="Container image with tessera and the accelerator stack (k8s pools)."
    )
    namespace: str = Field("default", description="Kubernetes namespace for the training job (k8s pools).")
    credentials_secret: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Kubernetes Secret whose keys become the trainer's environment, e.g. AWS_ACCESS_KEY_ID "
        "for the buckets (k8s pools); the spec holds only its name. Process pools use the worker's environment.",
    )

    @property
    def pool(self) -> str:
        return self.work_pool or f"tessera-{self.accelerator}"


class EvalSpec(Strict):
    """Checkpoint validation and evaluation, run while training and on a schedule."""

    enabled: bool = Field(True, description="Validate and evaluate each new committed checkpoint.")
    batches: int = Field(8, ge=1, description="Validation batches per evaluation.")
    sample_prompt: str = Field("def ", description="Prompt for the greedy sample shown with each evaluation.")
    sample_tokens: int = Field(32, ge=0, description="Tokens to generate for the sample.")
    poll_interval_s: float = Field(2.0, gt=0, description="How often the watcher looks for new checkpoints.")


class TrainingSpec(Strict):
    """A training deployment: model, data, layout, cluster, and the policies around them."""

    name: str = Field("tiny-local", pattern=NAME_PATTERN, description="Run name (lowercase, digits, '-').")
    seed: int = Field(0, ge=0, description="Seed for init and data order: same seed, same loss curve.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Architecture.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus, tokenizer, shards.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Batch geometry and length.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallel layout.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Hardware and work pool.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW and LR schedule.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint policy.")
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="Failure handling.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Validation and evaluation.")
    allow_oversubscribe: bool = Field(
        False, description="Launch even if the planner estimates the job does not fit in HBM."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        cluster = self.cluster
        if cluster.chip not in CHIPS or CHIPS[cluster.chip].accelerator != cluster.accelerator:
            raise ValueError(
                f"cluster.chip={cluster.chip!r} is not a {cluster.accelerator} chip; "
                f"use one of {', '.join(chips_for(cluster.accelerator))}"
            )
        errors = layout_errors(self.model, self.parallel, self.train, cluster)
        if self.data.source == "files" and not self.data.paths:
            errors.append("data.source=files needs data.paths (files, globs or gs:// / s3:// URLs)")
        if errors:
            raise ValueError("; ".join(errors))
        if not self.allow_oversubscribe:
            misfit = fit_error(self.model, self.parallel, self.train, cluster, self.checkpoint)
            if misfit:
                raise ValueError(misfit)
        return self

    def job_config(self, data_url: str | None, checkpoint_interval_steps: int | None = None) -> JobConfig:
        """The part the torchrun entry point needs, as the trainer's own config."""
        return JobConfig(
            name=self.name,
            seed=self.seed,
            model=self.model,
            parallel=self.parallel,
            train=self.train,
            optimizer=self.optimizer,
            checkpoint=self.checkpoint,
            faults=self.faults,
            hardware=HardwareConfig(**self.cluster.model_dump(include=set(HardwareConfig.model_fields))),
            data_url=data_url,
            loader_workers=self.data.loader_workers,
            checkpoint_interval_steps=checkpoint_interval_steps,
        )


class SpecError(ValueError):
    """A user error in a spec: printed as one readable message, never a traceback."""


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (tessera schema lists every field)"
        lines.append(f"{loc}: {msg}")
    return "\n".join(lines)


def parse_spec(data: object, source: str = "spec") -> TrainingSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of spec fields, got {type(data).__name__}")
    try:
        return TrainingSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source} is invalid:\n{format_validation_error(exc)}") from None


def load_spec(path: str | Path, overrides: dict[str, object] | None = None) -> TrainingSpec:
    """Read a YAML (or JSON, which is YAML) spec file, with user errors as :class:`SpecError`.

    ``overrides`` replace top-level fields before validation (``tessera plan`` plans a spec that does
    not fit by overriding ``allow_oversubscribe``).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"cannot read spec {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from None
    if overrides and isinstance(data, dict):
        data = {**data, **overrides}
    return parse_spec(data, str(path))

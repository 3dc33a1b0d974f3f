"""The typed deployment spec: one tree that is the CLI input, the Prefect flow parameter and the UI form.

``TrainingSpec`` composes the trainer's own configs (``trainer/config.py``) with cluster, data-prep
and eval settings, and validates everything that can be known before launch — including whether
the plan fits in HBM — so a bad spec fails with the field and the fix, never on the cluster.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, Field, ValidationError, model_validator

from deployments.form import form_rules
from trainer.backends.chips import CHIPS, chips_for
from trainer.config import (
    NO_CONTROL_CHARACTERS,
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
)
from trainer.elastic import elastic_errors
from trainer.layout_checks import layout_errors, muon_errors
from trainer.plan import fit_error
from trainer.replicas import replica_ft_errors

SPEC_DIR = Path(__file__).parent / "specs"
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?$"  # a valid Kubernetes name, so job names derive from it
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # a Kubernetes namespace
POOL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
# An OCI image reference: [registry[:port]/]path[:tag][@sha256:digest]; no spaces, quotes or newlines.
IMAGE_PATTERN = (
    r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$"
)
# A run id is the spec's name and 8 hex digits of the flow run that started it: still a DNS label.
RUN_ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?-[0-9a-f]{8}$"
PATTERN_MEANING = {
    NAME_PATTERN: "a name of lowercase letters, digits and '-' (at most 48, starting and ending alphanumeric)",
    DNS_LABEL: "a Kubernetes namespace: lowercase letters, digits and '-' (at most 63)",
    POOL_PATTERN: "a work pool name: letters, digits, '_', '.' and '-'",
    IMAGE_PATTERN: "an image reference such as registry.example.com/team/tessera:tag",
    RUN_ID_PATTERN: "a run id such as tiny-local-3f2a9c1b (a spec name, '-', 8 hex digits)",
    NO_CONTROL_CHARACTERS: "a path or URL without control characters (NUL, newline, tab)",
}


class ClusterSpec(HardwareConfig):
    """Where the job runs: hardware plus the Prefect work pool and container image."""

    chip: str = Field(
        "cpu",
        description="Chip type from the catalog; it must be one of the accelerator's chips.",
        json_schema_extra={"enum": list(CHIPS)},  # a choice in the form, not free text
    )
    work_pool: str | None = Field(
        None, pattern=POOL_PATTERN, description="Prefect work pool; default tessera-ACCELERATOR."
    )
    image: str = Field(
        "tessera:latest",
        pattern=IMAGE_PATTERN,
        description="Container image with tessera and the accelerator stack (k8s pools).",
    )
    namespace: str = Field(
        "default", pattern=DNS_LABEL, description="Kubernetes namespace for the training job (k8s pools)."
    )
    credentials_secret: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Kubernetes Secret whose keys become the trainer's environment, e.g. AWS_ACCESS_KEY_ID "
        "(k8s pools).",
    )
    queue: str | None = Field(
        None,
        pattern=DNS_LABEL,
        description="Kueue LocalQueue that admits the training JobSet as one gang (k8s pools); empty: not "
        "queued.",
    )
    service_account: str | None = Field(
        None,
        pattern=DNS_LABEL,
        description="Service account of the training pods, e.g. one with bucket access (k8s pools); empty: "
        "the namespace's default.",
    )

    @property
    def pool(self) -> str:
        return self.work_pool or f"tessera-{self.accelerator}"


class EvalSpec(Strict):
    """Checkpoint validation and evaluation, run while training and on a schedule."""

    enabled: bool = Field(True, description="Validate and evaluate each new committed checkpoint.")
    # 16 × the demo's micro-batch of 4 = 64 samples: enough, drawn across the split, for its curve to move.
    batches: int = Field(
        16,
        ge=1,
        le=10_000,
        description="Validation micro-batches per evaluation, drawn by seed across the split's shards.",
    )
    max_concurrent: int = Field(
        1,
        ge=1,
        le=64,
        description="Checkpoint validations (each with its evaluation) at once, beside training and after "
        "it: a checkpoint committed meanwhile waits, and the newest waiting one goes next.",
    )
    sample_prompt: str = Field("def ", description="Prompt for the greedy sample shown with each evaluation.")
    sample_tokens: int = Field(32, ge=0, le=4096, description="Tokens to generate for the sample.")
    poll_interval_s: float = Field(
        2.0, gt=0, le=3600, description="How often the watcher looks for new checkpoints."
    )


class TrainingSpec(Strict):
    """A training deployment: model, data, layout, cluster, and the policies around them."""

    model_config = ConfigDict(json_schema_extra=form_rules)

    # Fields are in the order of the run form, read top-down: what people change on most runs (model,
    # length and batch, cluster, layout), then the data, then the policies, then run continuation.

    name: str = Field("tiny-local", pattern=NAME_PATTERN, description="Run name (lowercase, digits, '-').")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Architecture.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Run length and batch geometry.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Hardware and work pool.")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="How the model is cut across the cluster's chips."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus, tokenizer, shards.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW and LR schedule.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint policy.")
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="Failure handling.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Validation and evaluation.")
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="Seed for init and data order: same seed, same loss curve.",
    )
    allow_oversubscribe: bool = Field(
        False, description="Launch even if the planner estimates the job does not fit in HBM."
    )
    resume_from: str | None = Field(
        None,
        pattern=RUN_ID_PATTERN,
        description="Continue this earlier run: its run id (its directory under runs/), e.g. "
        "tiny-local-3f2a9c1b; empty: a new run.",
    )
    allow_changes: list[str] = Field(
        default_factory=list,
        description="Fields that may differ from the continued run, e.g. optimizer.lr or train (a whole "
        "section); other training changes are refused.",
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
        errors += elastic_errors(self.model, self.parallel, self.train, cluster, self.faults)
        errors += replica_ft_errors(self.parallel, self.faults, self.checkpoint, cluster.nodes)
        errors += warmup_errors(self.optimizer, self.train)
        errors += muon_errors(self.optimizer, self.model, self.parallel)
        if self.data.source == "files" and not self.data.paths:
            errors.append("data.source=files needs data.paths (files, globs or gs:// / s3:// URLs)")
        if errors:
            raise ValueError("; ".join(errors))
        if not self.allow_oversubscribe:
            misfit = fit_error(self.model, self.parallel, self.train, cluster, self.checkpoint)
            if misfit:
                raise ValueError(misfit)
        return self

    def job_config(self, data_url: str | None, run_id: str | None = None) -> JobConfig:
        """The part the torchrun entry point needs, as the trainer's own config (unresolved: see
        ``deployments.run.Run``, which decides the checkpoint location and cadence).

        Constructed, not validated again: every part comes from this spec, whose validation has already
        checked the layout; ``JobConfig``'s own check is for a job file read from disk."""
        return JobConfig.model_construct(
            name=self.name,
            run_id=run_id,
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
        )


def warmup_errors(optimizer: OptimizerConfig, train: TrainConfig) -> list[str]:
    """A warmup longer than the run never reaches optimizer.lr: refused when the spec sets it; the
    default (10) is cut to the run's length, so a short run's spec needs no warmup of its own."""
    if optimizer.warmup_steps <= train.steps:
        return []
    if "warmup_steps" not in optimizer.model_fields_set:
        object.__setattr__(optimizer, "warmup_steps", train.steps)  # skips validate_assignment's recursion
        return []
    return [
        f"optimizer.warmup_steps={optimizer.warmup_steps} exceeds train.steps={train.steps}: the run would "
        f"end before its learning rate reaches optimizer.lr; set warmup_steps at most {train.steps}"
    ]


class SpecError(ValueError):
    """A user error in a spec: printed as one readable message, never a traceback."""


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        # pydantic adds the member of a union it tried (e.g. "constrained-int"): not a field name.
        loc = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or str(p).isidentifier()) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (tessera schema lists every field)"
        elif err["type"] == "string_pattern_mismatch":
            meaning = PATTERN_MEANING.get(err["ctx"]["pattern"], f"of the form {err['ctx']['pattern']}")
            msg = f"{err['input']!r} is not {meaning}"
        lines.append(f"{loc}: {msg}")
    return "\n".join(lines)


def parse_spec(data: object, source: str = "spec") -> TrainingSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of spec fields, got {type(data).__name__}")
    try:
        return TrainingSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"{source} is invalid:\n{format_validation_error(exc)}") from None


def apply_overrides(spec: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """``spec`` with each ``field.path=value`` set (``tessera submit --set``); values are YAML, so
    ``train.steps=30``, ``optimizer.lr=1e-3`` and ``data.paths=[a.txt, b.txt]`` mean what they say.
    Unknown fields are left for validation to refuse, naming them."""
    merged = copy.deepcopy(spec)
    for assignment in assignments:
        path, sep, text = assignment.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise SpecError(f"--set {assignment!r}: write FIELD=VALUE, e.g. --set train.steps=30")
        section = merged
        for key in keys[:-1]:
            section = section.setdefault(key, {})
            if not isinstance(section, dict):
                raise SpecError(f"--set {assignment!r}: {key} is not a section of the spec")
        try:
            section[keys[-1]] = read_yaml(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"--set {assignment!r}: the value is not valid YAML: {exc}") from None
    return merged


MAX_SPEC_BYTES = 1 << 20  # a spec is a page of YAML; anything far larger is a wrong file


class SpecLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's floats: PyYAML (YAML 1.1) reads ``lr: 1e-3`` as the string "1e-3", which
    the spec, being strict, would refuse; people write it, so it is a float here as in JSON.

    A key given twice in one mapping is an error (YAML 1.2 says keys are unique; PyYAML keeps the last
    silently, so ``train: {steps: 12, steps: 100000}`` trained 100,000 steps).
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden by design
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(text: str) -> object:
    return yaml.load(text, Loader=SpecLoader)


def load_spec(path: str | Path, overrides: dict[str, object] | None = None) -> TrainingSpec:
    """Read a YAML (or JSON, which is YAML) spec file, with user errors as :class:`SpecError`.

    Refused in one line, before YAML sees them: what is not a regular file (a FIFO would block the
    read forever), more than :data:`MAX_SPEC_BYTES`, bytes that are not UTF-8, nesting too deep to parse.
    ``overrides`` replace top-level fields before validation (``tessera plan`` plans a spec that does
    not fit by overriding ``allow_oversubscribe``).
    """
    path = Path(path)
    try:
        if path.exists() and not path.is_file():
            raise SpecError(f"spec {path} is not a regular file; give the path of a YAML spec")
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError(
                f"spec {path} is {path.stat().st_size:,} bytes, over {MAX_SPEC_BYTES:,}; is it the right file?"
            )
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read spec {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"spec {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise SpecError(f"{path} nests too deeply to be a spec") from None
    if overrides and isinstance(data, dict):
        data = {**data, **overrides}
    return parse_spec(data, str(path))

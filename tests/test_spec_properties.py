"""Untrusted specs (UI parameters, CLI files): every input validates and plans, or is one SpecError
naming the field — never another exception, never a traceback. Property-based, no processes."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import tempfile
import time
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import validate

from deployments.spec import SpecError, TrainingSpec, load_spec, parse_spec
from flows.pipeline import train_pipeline
from trainer.config import JobConfig
from trainer.failures import UserError
from trainer.plan import plan_for_job

BASE: dict[str, Any] = {
    "name": "props",
    "model": {"preset": "tiny"},
    "train": {"steps": 4, "seq_len": 32, "global_batch_size": 4, "micro_batch_size": 2},
    "parallel": {"dp_shard": 2},
    "cluster": {"chips_per_node": 2},
}
# Issue 29: every check is bounded in time, whatever the numbers are. Timed in this process's CPU
# seconds, not wall time: a busy box (other processes on both cores) stretches wall time, not this.
VALIDATE_BOUND_S = 2.0
SECTIONS = [name for name, info in TrainingSpec.model_fields.items() if info.annotation is not str]

# Magnitudes at and past every bound a spec has (counts < 2³¹, seeds < 2⁶³, floats to the largest double).
extreme_numbers = st.sampled_from(
    [
        0,
        1,
        3,
        2**31 - 1,
        2**31,
        2**63 - 1,
        2**64,
        10**7,
        10**15,
        -1,
        1e-300,
        5e-324,
        1e300,
        1.7976931348623157e308,
    ]
) | st.integers(min_value=-(2**70), max_value=2**70)
# Places tessera writes, with control characters, unknown protocols and escapes mixed in.
locations = st.builds(
    lambda prefix, rest: prefix + rest,
    st.sampled_from(
        ["", "data/", "/abs/", "../", "s3://bucket/", "gs://b/", "nosuch://b/", "file://", "memory://x/"]
    ),
    st.text(st.characters(codec="utf-8", categories=["Cc", "Ll", "Nd", "Po"]), max_size=10),
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | extreme_numbers
    | locations,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def field_names(section: str) -> list[str]:
    annotation = TrainingSpec.model_fields[section].annotation
    fields = getattr(annotation, "model_fields", {})
    return sorted(fields) or ["x"]


@st.composite
def mutated_specs(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """The base spec with one field (known or unknown) of one section set to any JSON value."""
    spec = copy.deepcopy(BASE)
    section = draw(st.sampled_from(sorted(TrainingSpec.model_fields)))
    if section in SECTIONS and field_names(section) != ["x"]:
        key = draw(st.sampled_from(field_names(section)) | st.text(min_size=1, max_size=8))
        spec[section] = {**spec.get(section, {}), key: draw(json_values)}
    else:
        spec[section] = draw(json_values)
    return spec, section


def accept_or_name_the_field(spec: dict[str, Any], section: str) -> None:
    start = time.process_time()
    try:
        parsed = parse_spec(spec, "ui")
    except SpecError as error:
        assert time.process_time() - start < VALIDATE_BOUND_S, spec
        assert str(error).startswith("ui is invalid:\n")
        # The field's path, or the section whose cross-field check failed (e.g. the layout).
        assert section in str(error) or "\nspec: " in str(error), str(error)
        return
    assert time.process_time() - start < VALIDATE_BOUND_S, spec
    # The job it becomes is one the trainer accepts when it reads job.json.
    job = JobConfig.model_validate_json(parsed.job_config(data_url=None).model_dump_json())
    # A spec that validates but does not fit the cluster is a clear user error, before any launch.
    with contextlib.suppress(UserError):
        plan_for_job(job)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None)
@given(mutated_specs())
@example((BASE | {"model": {"preset": "custom", "n_layers": 10**15, "dim": 64, "n_heads": 4}}, "model"))
@example((BASE | {"name": "../escape"}, "name"))
@example((BASE | {"name": "naïve-run"}, "name"))
@example((BASE | {"name": "/abs/path"}, "name"))
@example((BASE | {"trian": {"steps": 1}}, "trian"))
def test_every_spec_validates_or_is_rejected_naming_a_field(case: tuple[dict[str, Any], str]) -> None:
    accept_or_name_the_field(*case)


def as_yaml(value: object) -> str:
    """JSON, which is YAML, with non-ASCII kept as is (YAML reads JSON's surrogate-pair escapes as two
    characters) except what a YAML stream may not hold raw, escaped (it only appears inside strings)."""
    text = json.dumps(value, ensure_ascii=False)
    return re.sub("[\x7f-\x9f\ud800-\udfff\ufffe\uffff]", lambda m: f"\\u{ord(m.group()):04x}", text)


@st.composite
def yaml_with_a_duplicate_key(draw: st.DrawFn) -> tuple[str, str]:
    """A spec file in which one key of some mapping (top level or a section) is given twice."""
    spec, _ = draw(mutated_specs())
    sections = [key for key, value in spec.items() if isinstance(value, dict) and value]
    where = draw(st.sampled_from([None, *sections]))
    mapping = spec if where is None else spec[where]
    key = draw(st.sampled_from(sorted(mapping)))
    entries = [f"{as_yaml(k)}: {as_yaml(v)}" for k, v in mapping.items()]
    entries.insert(draw(st.integers(0, len(entries))), f"{as_yaml(key)}: {as_yaml(draw(json_values))}")
    body = "{" + ", ".join(entries) + "}"
    if where is not None:
        body = as_yaml({k: v for k, v in spec.items() if k != where})[:-1] + f", {as_yaml(where)}: {body}}}"
    return body, key


@settings(max_examples=300, deadline=None)
@given(yaml_with_a_duplicate_key())
def test_a_key_given_twice_anywhere_is_refused_naming_it(case: tuple[str, str]) -> None:
    text, key = case
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates cannot be in a file at all
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        start = time.process_time()
        with pytest.raises(SpecError) as refused:
            load_spec(file.name)
    assert time.process_time() - start < VALIDATE_BOUND_S
    assert f"key {key!r} appears twice" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("name", ["../x", "a/b", "run\u202e", "Ü", "x" * 60, ".", ""])
def test_names_that_could_escape_or_break_the_run_directory_are_rejected(name: str) -> None:
    with pytest.raises(SpecError, match=r"^ui is invalid:\nname: "):
        parse_spec(BASE | {"name": name}, "ui")


@pytest.mark.parametrize("data", [None, [], "train: 1", 3])
def test_a_spec_that_is_not_a_mapping_is_one_clear_error(data: object) -> None:
    with pytest.raises(SpecError, match="expected a mapping of spec fields"):
        parse_spec(data, "ui")


PIPELINE_SCHEMA = parameter_schema(train_pipeline).model_dump_for_openapi()


def server_accepts(spec: dict[str, Any]) -> bool:
    """What the Prefect server decides for a run's parameters: the deployment's JSON schema, checked
    by the same function the server's API calls before it creates a flow run."""
    return not validate({"spec": spec}, PIPELINE_SCHEMA, raise_on_error=False)


def spec_accepts(spec: dict[str, Any]) -> bool:
    """What `tessera validate`, `tessera run` and the flow's own parameter check decide."""
    try:
        parse_spec(spec, "door")
    except SpecError:
        return False
    return True


# No per-example deadline: a busy machine slows examples down, and speed is not what this checks.
@pytest.mark.slow
@settings(max_examples=2000, deadline=None)
@given(mutated_specs())
@example((BASE | {"train": {**BASE["train"], "steps": True}}, "train"))
@example((BASE | {"optimizer": {"lr": float("inf")}}, "optimizer"))
@example((BASE | {"seed": 2**64}, "seed"))
@example((BASE | {"data": {"loader_workers": 100_000}}, "data"))
@example((BASE | {"cluster": {**BASE["cluster"], "namespace": "x; rm -rf /"}}, "cluster"))
@example((BASE | {"faults": {"collective_timeout_s": 1e300}}, "faults"))
def test_a_spec_the_cli_accepts_the_server_accepts_too(case: tuple[dict[str, Any], str]) -> None:
    """One door: nothing passes `tessera validate` and is then refused by the server (or the reverse
    for anything JSON schema can say; rules across fields, and finiteness, which JSON cannot express,
    are the flow's first check, within seconds of the run starting)."""
    spec, _ = case
    if spec_accepts(spec):
        assert server_accepts(json.loads(json.dumps(spec))), spec


def timed_validate(spec: dict[str, Any]) -> float:
    """Seconds ``parse_spec`` took to accept or refuse ``spec`` (a refusal is a SpecError, never another)."""
    start = time.process_time()
    with contextlib.suppress(SpecError):
        parse_spec(spec, "ui")
    return time.process_time() - start


@pytest.mark.parametrize(
    "model",
    [
        {"preset": "tiny", "n_layers": 10_000_000},
        {"preset": "tiny-moe", "n_layers": 2**31 - 1},
        {"preset": "tiny", "n_layers": 2**31 - 1},
        {"preset": "custom", "n_layers": 2**31 - 2, "dim": 2**30, "n_heads": 2**29, "n_kv_heads": 1,
         "ffn_dim": 2**31 - 1, "vocab_size": 2**31 - 1, "rope_theta": 1e300},
    ],
)  # fmt: skip
def test_validating_a_huge_model_is_bounded_in_time(model: dict[str, Any]) -> None:
    """The fit check plans per layer kind, not per layer, and lists divisors from a factorisation, so
    ten million layers (or 2³¹) validate as fast as two."""
    assert timed_validate(BASE | {"model": model}) < VALIDATE_BOUND_S

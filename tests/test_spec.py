"""Spec validation: every preset parses, and every bad spec names the field and the fix."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from deployments.spec import SPEC_DIR, SpecError, TrainingSpec, apply_overrides, load_spec, parse_spec

SPECS = sorted(SPEC_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_specs_validate(path: Path) -> None:
    spec = load_spec(path)
    assert spec.parallel.world_size == spec.cluster.nodes * spec.cluster.chips_per_node


def test_preset_fills_dimensions_and_override_wins() -> None:
    spec = parse_spec({"model": {"preset": "llama3-8b", "n_layers": 4}, "allow_oversubscribe": True})
    assert (spec.model.dim, spec.model.n_kv_heads, spec.model.vocab_size) == (4096, 8, 128256)
    assert spec.model.n_layers == 4


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"parallel": {"dp_shard": 3}}, "make the degrees multiply"),
        (
            {"parallel": {"tp": 3}, "cluster": {"chips_per_node": 3}},
            "parallel.tp=3 must divide model.n_heads",
        ),
        ({"parallel": {"pp": 3}, "cluster": {"chips_per_node": 3}}, "must divide model.n_layers"),
        (
            {"parallel": {"cp": 3}, "cluster": {"chips_per_node": 3}, "train": {"seq_len": 100}},
            "train.seq_len=100 must be divisible by 2·cp·tp=6",
        ),
        ({"parallel": {"cp": 2, "pp": 2}, "cluster": {"chips_per_node": 4}}, "set pp=1 or cp=1"),
        ({"parallel": {"cp": 2, "compile": True}, "cluster": {"chips_per_node": 2}}, "set compile=false"),
        (
            {"model": {"preset": "tiny-moe"}, "parallel": {"cp": 2}, "cluster": {"chips_per_node": 2}},
            "parallel.cp=2 with a mixture-of-experts model (model.moe) is not supported",
        ),
        ({"parallel": {"cp": 2}}, "dp_replicate×dp_shard×cp×tp×pp = 1×1×2×1×1 = 2"),
        ({"train": {"global_batch_size": 6, "micro_batch_size": 4}}, "train.global_batch_size=6"),
        (
            {"parallel": {"pp": 2, "pp_schedule": "zbv_zero_bubble"}, "cluster": {"chips_per_node": 2}},
            "set parallel.pp_virtual_stages=2",
        ),
        (
            {
                "parallel": {"pp": 2, "pp_schedule": "dualpipev", "pp_virtual_stages": 2},
                "cluster": {"chips_per_node": 2},
            },
            "dualpipev needs at least 2·pp=4 micro-batches",
        ),
        (
            {"parallel": {"float8": "tensorwise", "mixed_precision": "bf16"}},
            "parallel.float8=tensorwise needs a GPU with fp8 matmuls, but chip 'cpu' has none",
        ),
        ({"cluster": {"accelerator": "gpu", "chip": "tpu-v5p"}}, "cluster.chip='tpu-v5p' is not a gpu chip"),
        ({"modle": {}}, "modle: unknown field"),
        ({"train": {"steps": -1}}, "train.steps: Input should be greater than or equal to 1"),
        ({"model": {"preset": "custom", "dim": 64}}, "model.preset=custom needs model.n_layers"),
        ({"name": "Bad Name!"}, "name: 'Bad Name!' is not a name of lowercase letters, digits and '-'"),
        ({"optimizer": {"lr": 1e300}}, "optimizer.lr: 1e+300 is above 1.0: AdamW moves every weight"),
        (
            {"train": {"steps": 12}, "optimizer": {"warmup_steps": 100}},
            "optimizer.warmup_steps=100 exceeds train.steps=12: the run would end before its learning rate "
            "reaches optimizer.lr",
        ),
        (
            {"checkpoint": {"write_bandwidth_gbps": 1e-300, "interval": "auto"}},
            "checkpoint.write_bandwidth_gbps: Input should be greater than or equal to 0.001",
        ),
    ],
)
def test_bad_specs_name_the_field(patch: dict, needle: str) -> None:
    with pytest.raises(SpecError, match=None) as info:
        parse_spec(patch)
    assert needle in str(info.value)


def test_malformed_yaml_is_one_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(bad)


def test_a_key_given_twice_is_refused_naming_it(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: this would have trained 100,000 steps, not 12."""
    spec = tmp_path / "dup.yaml"
    spec.write_text("train:\n  steps: 12\n  seq_len: 32\n  steps: 100000\n")
    with pytest.raises(SpecError, match=r"not valid YAML: key 'steps' appears twice in one mapping") as info:
        load_spec(spec)
    assert "line 4" in str(info.value)
    with pytest.raises(SpecError, match="key 'steps' appears twice"):
        apply_overrides({}, ["train={steps: 12, steps: 100000}"])
    merged = tmp_path / "merge.yaml"  # a YAML merge key's values may be overridden: that is its purpose
    merged.write_text("train: &t {steps: 4, seq_len: 32}\neval:\n  <<: {batches: 2}\n  batches: 3\n")
    assert load_spec(merged).eval.batches == 3


def test_the_default_warmup_is_cut_to_a_short_run_and_a_given_one_is_not() -> None:
    assert parse_spec({"train": {"steps": 4}}).optimizer.warmup_steps == 4
    assert parse_spec({"train": {"steps": 40}}).optimizer.warmup_steps == 10
    assert parse_spec({"train": {"steps": 4}, "optimizer": {"warmup_steps": 4}}).optimizer.warmup_steps == 4


def test_an_auto_interval_is_a_count_a_job_accepts_whatever_the_mtbf() -> None:
    """A years-long MTBF makes Young/Daly's interval astronomically long: it is capped, not refused
    by the trainer's job file after launch."""
    from trainer.config import MAX_COUNT
    from trainer.plan import resolve_checkpoint_interval

    spec = parse_spec({"cluster": {"mtbf_hours": 1e300}, "checkpoint": {"interval": "auto"}})
    assert resolve_checkpoint_interval(spec.job_config(data_url=None)) == MAX_COUNT


def test_schema_documents_every_field() -> None:
    schema = TrainingSpec.model_json_schema()

    def walk(node: dict, where: str) -> None:
        for name, prop in node.get("properties", {}).items():
            assert prop.get("description"), f"{where}.{name} has no description"

    walk(schema, "spec")
    for name, definition in schema["$defs"].items():
        walk(definition, name)
    accel = schema["$defs"]["ClusterSpec"]["properties"]["accelerator"]
    assert accel["enum"] == ["cpu", "gpu", "tpu", "trainium"]


def test_set_overrides_merge_into_a_spec_and_bad_ones_name_themselves() -> None:
    deployed = {"name": "tiny-local", "train": {"steps": 60, "seq_len": 128}, "data": {"max_documents": 400}}
    merged = apply_overrides(deployed, ["train.steps=30", "optimizer.lr=1e-3", "data.paths=[a.txt, b.txt]"])
    assert merged == {
        "name": "tiny-local",
        "train": {"steps": 30, "seq_len": 128},
        "data": {"max_documents": 400, "paths": ["a.txt", "b.txt"]},
        "optimizer": {"lr": 0.001},
    }
    assert deployed["train"]["steps"] == 60  # the deployment's own spec is not touched
    with pytest.raises(SpecError, match="write FIELD=VALUE"):
        apply_overrides(deployed, ["train.steps"])
    with pytest.raises(SpecError, match="name is not a section of the spec"):
        apply_overrides(deployed, ["name.first=x"])


@pytest.mark.parametrize(
    ("location", "refusal"),
    [
        ("", "is empty"),
        ("/", "is the filesystem root"),
        ("../elsewhere", "leaves the working directory"),
        ("data/../../elsewhere", "leaves the working directory"),
        ("s3://", "names no bucket or path"),
        ("nosuch://bucket/x", "nosuch:// is not a storage protocol fsspec knows"),
        ("data\x00x", "is not a path or URL without control characters"),
        ("s3://bucket/x\ny", "is not a path or URL without control characters"),
        ("ckpt\r", "is not a path or URL without control characters"),
    ],
)
def test_output_locations_are_confined_and_named(location: str, refusal: str) -> None:
    for field, patch in (
        ("data.output_url", {"data": {"output_url": location}}),
        ("checkpoint.url", {"checkpoint": {"url": location}}),
    ):
        with pytest.raises(SpecError, match=rf"\n{re.escape(field)}: .*{refusal}"):
            parse_spec(patch)


def test_output_locations_are_normalised() -> None:
    spec = parse_spec({"data": {"output_url": "data/./shards/"}, "checkpoint": {"url": "/abs//ckpt/"}})
    assert (spec.data.output_url, spec.checkpoint.url) == ("data/shards", "/abs/ckpt")
    assert parse_spec({"data": {"output_url": "s3://bucket/prefix"}}).data.output_url == "s3://bucket/prefix"


def test_spec_files_that_would_hang_or_blow_up_are_refused_in_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "# padding\n" * 200_000)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    cases = {
        fifo: "is not a regular file",
        big: "bytes, over 1,048,576",
        latin1: "is not UTF-8 text",
        deep: "nests too deeply",
        tmp_path / "missing.yaml": "cannot read spec",
    }
    for path, refusal in cases.items():
        with pytest.raises(SpecError, match=refusal) as error:
            load_spec(path)
        assert "\n" not in str(error.value)

"""``model.from_hf``: a Hugging Face config.json builds its family with its dimensions, read once at
validation; what it cannot build is refused naming the key. The fixtures in tests/data/hf/ are
hand-written config.json files in transformers' own key layout for each model type, at tiny sizes.
Round trips go through the real export and import (DCP's HF storage, real files); no hub, no
transformers: HF's Qwen attention is written out below from its modeling code."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from deployments.run import Run, RunConflict, training_changes
from deployments.spec import SpecError, load_spec, parse_spec
from tests.test_form import form_errors
from tests.test_hf_checkpoint import hf_rope, read_safetensors, train_and_save
from trainer.checkpoint.commit import check_model, read_commit
from trainer.checkpoint.errors import CheckpointMismatch
from trainer.checkpoint.hf import export_hf, import_hf
from trainer.config import JobConfig, ModelConfig
from trainer.evaluate import load_model
from trainer.failures import UserError
from trainer.models import family_of, param_count
from trainer.models.llama import LLAMA
from trainer.models.llama.model import Transformer, apply_rope, rope_table
from trainer.plan.params import count_params
from trainer.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "hf"
COMMON = dict(preset="custom", n_layers=2, dim=64, n_heads=4, vocab_size=256)
# What each fixture must build: the same model written as explicit fields.
EXPECTED: dict[str, dict[str, Any]] = {
    "llama": dict(COMMON, n_kv_heads=2, ffn_dim=160, rope_theta=5e5, norm_eps=1e-5),
    "mistral": dict(COMMON, n_kv_heads=1, ffn_dim=224, rope_theta=1e6, norm_eps=1e-5),
    "mixtral": dict(COMMON, n_kv_heads=2, ffn_dim=96, rope_theta=1e6, norm_eps=1e-5, moe=dict(n_experts=4, top_k=2)),
    "qwen2": dict(COMMON, n_kv_heads=2, ffn_dim=176, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True),
    "qwen3": dict(
        COMMON, n_kv_heads=2, ffn_dim=192, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qk_norm=True, head_dim=32
    ),
}  # fmt: skip


def fixture(model_type: str) -> str:
    return str(FIXTURES / model_type / "config.json")


def edited(tmp_path: Path, model_type: str, changes: dict[str, Any] | None = None) -> str:
    """A copy of a fixture with keys changed (None: removed)."""
    config = json.loads(Path(fixture(model_type)).read_text())
    for key, value in (changes or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp_path / f"{model_type}-edited" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    return str(path)


def job_of(model: dict[str, Any], seq_len: int = 16) -> JobConfig:
    return JobConfig.model_validate({"seed": 5, "model": model, "train": {"seq_len": seq_len}})


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_each_model_type_builds_its_family_with_its_dimensions(model_type: str) -> None:
    built = ModelConfig(from_hf=fixture(model_type))
    assert family_of(built) is LLAMA
    assert built.model_dump() == ModelConfig(**EXPECTED[model_type]).model_dump()
    assert built.from_hf == fixture(model_type)  # kept to show where it came from; no dump carries it
    # The planner's count is the built module's, bias and q/k norm gains included.
    with torch.device("meta"):
        module = Transformer(built, max_seq_len=8)
    assert count_params(built).total == param_count(module)


def test_qwen_features_are_the_parameters_the_planner_counts() -> None:
    base = ModelConfig(**EXPECTED["llama"], head_dim=24)
    both = ModelConfig(**EXPECTED["llama"], qkv_bias=True, qk_norm=True, head_dim=24)
    with torch.device("meta"):
        module = Transformer(both, max_seq_len=8)
    attention = module.layers["0"].attention
    shapes = [tuple(p.shape) for p in (attention.wq.weight, attention.wk.bias, attention.k_norm.weight)]
    assert shapes == [(96, 64), (48,), (24,)]
    assert count_params(both).total == param_count(module)
    # Per layer: q, k, v biases ((4 + 2 + 2) heads × 24) and two gains of 24; not matmul weights.
    assert count_params(both).total - count_params(base).total == 2 * (8 * 24 + 2 * 24)
    assert count_params(both).matmul == count_params(base).matmul


def test_dumps_carry_the_resolved_fields_so_nothing_reads_the_file_again(tmp_path: Path) -> None:
    path = edited(tmp_path, "qwen3")
    job = job_of({"from_hf": path})
    dumped = job.model_dump_json()
    assert "from_hf" not in dumped and '"head_dim":32' in dumped.replace(" ", "")
    Path(path).unlink()  # the trainer reads job.json: the file is not needed any more
    assert JobConfig.model_validate_json(dumped).model.model_dump() == job.model.model_dump()
    # The same model written out has the same fingerprint: a checkpoint does not know where it came from.
    assert job.model_fingerprint() == job_of(EXPECTED["qwen3"]).model_fingerprint()


def test_explicit_fields_override_the_file_and_preset_beside_it_is_refused() -> None:
    shallow = ModelConfig(from_hf=fixture("llama"), n_layers=1, attention="document")
    assert (shallow.n_layers, shallow.dim, shallow.attention) == (1, 64, "document")
    biased = ModelConfig(from_hf=fixture("mixtral"), moe={"balance": "bias"})  # moe: merged key by key
    assert (biased.moe.n_experts, biased.moe.top_k, biased.moe.balance) == (4, 2, "bias")
    with pytest.raises(ValidationError, match=r"model\.preset='tiny' and model\.from_hf both set"):
        ModelConfig(from_hf=fixture("llama"), preset="tiny")


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        (
            "llama",
            {"model_type": "gpt2"},
            "model_type 'gpt2', which tessera does not build; supported: llama, ",
        ),
        ("llama", {"hidden_size": None}, "config.json has no hidden_size"),
        ("llama", {"hidden_size": "64"}, "hidden_size='64' in config.json is not a positive integer"),
        ("llama", {"rope_theta": None}, "no rope_theta"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling type 'yarn': tessera's RoPE scales only as Llama 3.1's",
        ),
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling type 'llama3' without low_freq_factor, high_freq_factor",
        ),
        ("llama", {"attention_bias": True}, "attention_bias=true puts biases on o_proj"),
        ("llama", {"mlp_bias": True}, "mlp_bias=true"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("mistral", {"sliding_window": 4096}, "sliding-window attention (sliding_window=4096"),
        ("qwen2", {"use_sliding_window": True}, "sliding-window attention (sliding_window=32768"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
        ("qwen3", {"attention_bias": True}, "attention_bias=true"),
    ],
)
def test_what_tessera_would_build_differently_is_refused_naming_the_key(
    tmp_path: Path, model_type: str, changes: dict[str, Any], message: str
) -> None:
    path = edited(tmp_path, model_type, changes)
    with pytest.raises(SpecError) as refused:
        parse_spec({"model": {"from_hf": path}}, "spec.yaml")
    assert str(refused.value).startswith(f"spec.yaml is invalid:\nmodel: model.from_hf={path!r}")
    assert message in str(refused.value), str(refused.value)


def test_a_missing_unreadable_or_malformed_file_names_the_field_and_the_fix(tmp_path: Path) -> None:
    cases = {
        str(tmp_path / "nope.json"): "no such file; give the path of a Hugging Face config.json",
        "Qwen/Qwen3-0.6B": "no such file",  # a Hub id is not a path, and the Hub is never read
        "hf://Qwen/Qwen3-0.6B": "is on the Hugging Face Hub, which tessera never reads",
    }
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases[str(tmp_path / "broken.json")] = "is not JSON (Expecting property name"
    cases[str(tmp_path / "list.json")] = "holds a JSON list, not the object of a config.json"
    (tmp_path / "dir").mkdir()
    cases[str(tmp_path / "dir")] = "no such file"  # a directory means its config.json, absent here
    for location, message in cases.items():
        with pytest.raises(SpecError, match=r"^spec\.yaml is invalid:\nmodel: ") as refused:
            parse_spec({"model": {"from_hf": location}}, "spec.yaml")
        assert message in str(refused.value), str(refused.value)
    # A directory holding a config.json is the file.
    shutil.copy(fixture("qwen2"), tmp_path / "dir" / "config.json")
    assert ModelConfig(from_hf=str(tmp_path / "dir")).qkv_bias


def test_resolving_a_config_imports_no_torch(tmp_path: Path) -> None:
    """Spec validation stays torch-free (the form and `tessera validate` start in well under a second),
    for each family's config.json."""
    from tests.test_hf_checkpoint import RELEASED_V2_LITE

    deepseek = tmp_path / "config.json"
    deepseek.write_text(json.dumps(RELEASED_V2_LITE))
    code = (
        "import sys; from trainer.config import ModelConfig; "
        f"[ModelConfig(from_hf=path) for path in ({fixture('qwen3')!r}, {str(deepseek)!r})]; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_a_changed_config_json_does_not_change_a_run_that_continues(tmp_path: Path) -> None:
    path = edited(tmp_path, "llama")
    spec = {"name": "fromhf", "model": {"from_hf": path}, "train": {"steps": 2, "seq_len": 16}}
    run = Run.open(parse_spec(spec), RunDir(tmp_path / "run"))
    assert json.loads(run.dir.record.read_text())["spec"]["model"]["n_layers"] == 2
    edited(tmp_path, "llama", {"num_hidden_layers": 3})
    with pytest.raises(RunConflict, match=r"model\.n_layers: 2 → 3"):
        Run.open(parse_spec(spec), RunDir(tmp_path / "run"))


# Llama 3.1's RoPE scaling, as its released config.json writes it.
LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

# As a spec writes it, from an original context of 8 tokens, so that a 16-token test reaches past it.
SHORT_SCALING = {
    **{k: v for k, v in LLAMA31_SCALING.items() if k != "rope_type"},
    "original_max_position_embeddings": 8,
}


def hf_llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """transformers' _compute_llama3_parameters, written out."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def test_llama3_rope_scaling_builds_and_is_hfs(tmp_path: Path) -> None:
    """Llama 3.1 8B's head width (128) and base: the table's frequencies are HF's scaled ones (they
    differ from plain RoPE in the low band); a config.json with it builds model.rope_scaling, and
    one with transformers 5's rope_parameters builds the same."""
    built = ModelConfig(from_hf=edited(tmp_path, "llama", {"rope_scaling": LLAMA31_SCALING}))
    assert built.rope_scaling is not None and built.rope_scaling.factor == 8.0
    v5 = edited(
        tmp_path, "mistral", {"rope_theta": None, "rope_parameters": {**LLAMA31_SCALING, "rope_theta": 5e5}}
    )
    assert ModelConfig(from_hf=v5).rope_scaling == built.rope_scaling
    table = rope_table(128, 4, 5e5, scaling=built.rope_scaling)
    ours = torch.atan2(table[1, :, 1], table[1, :, 0])  # position 1: the angle is the frequency
    expected = hf_llama3_inv_freq(128, 5e5, LLAMA31_SCALING)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=0)
    assert not torch.allclose(expected, hf_llama3_inv_freq(128, 5e5, {**LLAMA31_SCALING, "factor": 1.0}))


@pytest.mark.parametrize(
    "model",
    [
        EXPECTED["qwen2"],
        EXPECTED["qwen3"],
        EXPECTED["llama"],
        EXPECTED["mixtral"],
        dict(EXPECTED["llama"], rope_scaling=SHORT_SCALING),
    ],
    ids=["qwen2", "qwen3", "llama", "mixtral", "llama3.1-rope"],
)
def test_export_then_from_hf_and_import_gives_the_same_logits(model: dict[str, Any], tmp_path: Path) -> None:
    """A trained tessera model → HF safetensors + config.json → a spec built from that config.json alone,
    its weights imported → the same logits (fp32 export, so exactly)."""
    job = job_of(model)
    weights = train_and_save(job, str(tmp_path / "checkpoints"))
    out = export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf", dtype="fp32")
    rebuilt = job_of({"from_hf": str(out / "config.json")})
    assert rebuilt.model_fingerprint() == job.model_fingerprint()
    step_url = import_hf(out, rebuilt, str(tmp_path / "imported"))
    check_model(read_commit(step_url), rebuilt.model_fingerprint())
    _, imported = load_model(step_url, rebuilt)
    original = Transformer(job.model, max_seq_len=16)
    original.load_state_dict(weights)
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(imported(tokens), original(tokens))


def test_import_checks_the_qwen_architecture(tmp_path: Path) -> None:
    job = job_of(EXPECTED["qwen3"])
    train_and_save(job, str(tmp_path / "checkpoints"))
    out = export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    with pytest.raises(UserError, match="model_type 'qwen3' but the spec's model is llama"):
        import_hf(out, job_of(EXPECTED["llama"]), str(tmp_path / "a"))
    with pytest.raises(UserError, match=r"model\.head_dim=16 but head_dim=32"):
        import_hf(out, job_of({**EXPECTED["qwen3"], "head_dim": 16}), str(tmp_path / "b"))
    with pytest.raises(CheckpointMismatch):  # the fingerprint guards the import's commit record too
        check_model(
            read_commit(import_hf(out, job, str(tmp_path / "c"))),
            job_of(EXPECTED["qwen2"]).model_fingerprint(),
        )
    with pytest.raises(UserError, match="no Hugging Face architecture tessera converts holds them together"):
        export_hf(
            str(tmp_path / "checkpoints"), job_of({**EXPECTED["qwen3"], "qkv_bias": True}), tmp_path / "x"
        )


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: fp32 x · rsqrt(mean(x²) + eps), times the gain."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_exported_qwen_attention_computed_hfs_way_gives_tesseras_scores(
    model_type: str, tmp_path: Path
) -> None:
    """Qwen2Attention / Qwen3Attention written out: q = q_proj(x) (+ bias), viewed as heads, q_norm'd
    (Qwen3), then rotate-half RoPE; likewise k. Tessera's own modules, in pair order, give the same scores."""
    job = job_of(EXPECTED[model_type])
    cfg, hd, eps = job.model, job.model.head_dim, job.model.norm_eps
    weights = train_and_save(job, str(tmp_path / "checkpoints"))
    exported = read_safetensors(export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf", dtype="fp32"))
    model = Transformer(cfg, max_seq_len=16)
    model.load_state_dict(weights)
    attention = model.layers["0"].attention
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))

    def theirs(proj: str, heads: int) -> torch.Tensor:
        name = f"model.layers.0.self_attn.{proj}"
        out = x @ exported[f"{name}_proj.weight"].T
        if cfg.qkv_bias:
            out = out + exported[f"{name}_proj.bias"]
        out = out.view(2, 16, heads, hd)
        if cfg.qk_norm:
            out = hf_rms_norm(out, exported[f"{name}_norm.weight"], eps)
        return hf_rope(out, cfg.rope_theta)

    def ours(proj: str, heads: int) -> torch.Tensor:
        out = getattr(attention, f"w{proj}")(x).view(2, 16, heads, hd)
        if cfg.qk_norm:
            out = getattr(attention, f"{proj}_norm")(out)
        return apply_rope(out, model.rope)

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=2))

    with torch.no_grad():
        expected = scores(ours("q", cfg.n_heads), ours("k", cfg.n_kv_heads))
        torch.testing.assert_close(
            scores(theirs("q", cfg.n_heads), theirs("k", cfg.n_kv_heads)), expected, rtol=1e-5, atol=1e-5
        )
    # One AdamW step moved them off their init (zero biases, unit gains), so the check sees their order.
    feature = "wq.bias" if cfg.qkv_bias else "q_norm.weight"
    assert len(set(weights[f"layers.0.attention.{feature}"].tolist())) > 1


def test_the_spec_example_validates_from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its from_hf is relative to the working directory: the repository root, where Prefect's process
    workers run deployments (prefect deploy's default pull step) and where images keep the checkout."""
    monkeypatch.chdir(REPO)
    spec = load_spec(REPO / "deployments" / "specs" / "local-cpu-from-hf.yaml")
    assert spec.model.from_hf == "deployments/specs/hf/qwen3-tiny/config.json"
    assert (spec.model.qk_norm, spec.model.head_dim, spec.model.tie_embeddings) == (True, 64, True)


@pytest.mark.dist
def test_a_run_continues_from_imported_hf_weights(tmp_path: Path) -> None:
    """Real torchrun, one process, synthetic tokens. A from_hf run trains, its config.json deleted once
    the run is opened (the job carries the dimensions); its last checkpoint is exported to HF. A second
    run of a spec built from that export's config.json alone, with the weights imported into its
    checkpoint location, trains from them: at a learning rate too small to move them, its last
    checkpoint holds the first run's trained weights, not a fresh model's."""
    config = edited(tmp_path, "qwen3")
    spec: dict[str, Any] = {
        "name": "fromhf",
        "seed": 3,
        "model": {"from_hf": config},
        "data": {"loader_workers": 0},
        "train": {"steps": 4, "seq_len": 16, "global_batch_size": 4, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1},
        "checkpoint": {"interval": 4, "mode": "sync"},
        "faults": {"max_restarts": 0, "step_timeout_s": 60},
        "eval": {"enabled": False},
    }
    first = Run.open(parse_spec(spec), RunDir(tmp_path / "first"))
    Path(config).unlink()
    assert first.launch_local().returncode == 0
    out = export_hf(str(tmp_path / "first" / "checkpoints"), first.job, tmp_path / "hf", dtype="fp32")
    _, trained = load_model(str(tmp_path / "first" / "checkpoints" / "step-000004"), first.job)

    spec["model"] = {"from_hf": str(out / "config.json")}
    spec["train"]["steps"] = 2
    spec["optimizer"] = {"lr": 1e-12, "warmup_steps": 0, "weight_decay": 0.0}
    second = Run.open(parse_spec(spec), RunDir(tmp_path / "second"))
    import_hf(out, second.job, second.checkpoint_url)
    assert second.launch_local().returncode == 0
    _, continued = load_model(str(tmp_path / "second" / "checkpoints" / "step-000002"), second.job)
    for name, weight in trained.state_dict().items():
        torch.testing.assert_close(continued.state_dict()[name], weight, rtol=0, atol=1e-8)
    fresh = Transformer(second.job.model, max_seq_len=16)
    fresh.init_weights(second.job.seed)
    assert not torch.equal(
        fresh.state_dict()["layers.0.attention.wq.weight"],
        trained.state_dict()["layers.0.attention.wq.weight"],
    )


def test_the_run_form_leaves_a_from_hf_shape_to_the_spec(tmp_path: Path) -> None:
    """The form's tp/pp menus follow a preset's shape (tiny: 2 layers when preset is left out); a from_hf
    model's shape is in its file, so the server leaves the layout to the spec's own validation."""
    deep = edited(tmp_path, "llama", {"num_hidden_layers": 4})
    spec = {"model": {"from_hf": deep}, "parallel": {"pp": 4}, "cluster": {"chips_per_node": 4}}
    spec |= {"train": {"global_batch_size": 16, "micro_batch_size": 1}}
    assert form_errors(spec) == []
    assert parse_spec(spec).parallel.pp == 4
    assert ("spec.parallel.pp", "4 is not one of [1, 2]") in form_errors({**spec, "model": {}})


def test_a_run_recorded_before_the_newer_model_fields_continues() -> None:
    """run.json of a run from before qkv_bias, qk_norm, rope_scaling (and document attention) existed:
    continuing it with the same spec is no training change, as its fingerprint is none either."""
    spec = parse_spec({"name": "old", "model": {"preset": "tiny"}})
    earlier = spec.model_dump(mode="json")
    for name in ("qkv_bias", "qk_norm", "rope_scaling", "attention", "rope_positions"):
        del earlier["model"][name]
    assert training_changes(earlier, spec) == []
    changed = parse_spec({"name": "old", "model": {"preset": "tiny", "qk_norm": True}})
    assert training_changes(earlier, changed) == ["model.qk_norm: False → True"]


def test_qwen_attention_under_tensor_parallelism_is_refused_naming_the_fix() -> None:
    spec = {"model": {"from_hf": fixture("qwen3")}, "parallel": {"tp": 2}, "cluster": {"chips_per_node": 2}}
    with pytest.raises(
        SpecError, match=r"model\.qk_norm with parallel\.tp=2 is not supported; set parallel\.tp=1"
    ):
        parse_spec(spec)
    spec["model"] = {"from_hf": fixture("qwen2")}
    with pytest.raises(SpecError, match=r"model\.qkv_bias with parallel\.tp=2"):
        parse_spec(spec)
    spec["model"] = {"from_hf": fixture("llama")}
    assert parse_spec(spec).parallel.tp == 2


def test_a_config_in_an_object_store_is_read_through_fsspec() -> None:
    """fsspec's in-memory store stands in for gs:// and s3:// (the same url_to_fs path)."""
    import fsspec

    with fsspec.open("memory://models/qwen2/config.json", "wb") as file:
        file.write(Path(fixture("qwen2")).read_bytes())
    assert (
        ModelConfig(from_hf="memory://models/qwen2").model_dump()
        == ModelConfig(**EXPECTED["qwen2"]).model_dump()
    )


def test_a_deepseek_config_builds_the_deepseek_family_through_the_same_field(tmp_path: Path) -> None:
    """The registry dispatches on model_type: DeepSeek registers deepseek_v3/deepseek_v2 and its mapping's
    model_fields reads them (the released V2-Lite config.json, as tests/test_hf_checkpoint.py holds it)."""
    from tests.test_hf_checkpoint import RELEASED_V2_LITE

    path = tmp_path / "v2-lite" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(RELEASED_V2_LITE))
    built = ModelConfig(from_hf=str(path))
    assert family_of(built).name == "deepseek" and built.preset == "deepseek-custom"
    assert built.model_dump()["mla"] == ModelConfig(preset="deepseek-v2-lite").model_dump()["mla"]
    with pytest.raises(ValidationError, match=r"model\.qk_norm: options of the Llama family's attention"):
        ModelConfig(from_hf=str(path), qk_norm=True)

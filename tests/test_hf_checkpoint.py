"""Hugging Face export/import: a real tessera checkpoint → safetensors in HF Llama naming → back.

The checkpoint is written by the trainer's own CheckpointManager after a real optimizer step; export
and import go through DCP's HuggingFaceStorageWriter/Reader and real files. No hub is contacted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from typer.testing import CliRunner

from tessera.cli import app
from trainer.checkpoint import CheckpointManager, ModelOptimizerState
from trainer.checkpoint.hf import export_hf, import_hf
from trainer.config import CheckpointConfig, JobConfig, ModelConfig
from trainer.evaluate import load_model
from trainer.failures import UserError
from trainer.models import family_of
from trainer.models.deepseek import hf as deepseek_hf
from trainer.models.llama.model import Transformer, apply_rope
from trainer.rank.step_hooks import after_optimizer_step

MODEL = dict(
    preset="custom", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, rope_theta=5e5
)
JOB = JobConfig.model_validate({"seed": 3, "model": MODEL, "train": {"seq_len": 16}})
# transformers' LlamaForCausalLM names and shapes for MODEL (head_dim 16, 2 kv heads).
HF_LAYER = {
    "self_attn.q_proj.weight": (64, 64),
    "self_attn.k_proj.weight": (32, 64),
    "self_attn.v_proj.weight": (32, 64),
    "self_attn.o_proj.weight": (64, 64),
    "mlp.gate_proj.weight": (96, 64),
    "mlp.up_proj.weight": (96, 64),
    "mlp.down_proj.weight": (64, 96),
    "input_layernorm.weight": (64,),
    "post_attention_layernorm.weight": (64,),
}
HF_SHAPES = {
    "model.embed_tokens.weight": (128, 64),
    "model.norm.weight": (64,),
    "lm_head.weight": (128, 64),
    **{f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in HF_LAYER.items()},
}


def train_and_save(job: JobConfig, url: str) -> dict[str, torch.Tensor]:
    """Commit a checkpoint of job's model after one AdamW step at url; return its weights."""
    model = family_of(job.model).build(job.model, job.train.seq_len)
    model.init_weights(job.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(job.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    after_optimizer_step([model])  # moves routing biases (balance: bias) off zero
    manager = CheckpointManager(
        url, CheckpointConfig(mode="sync"), 1, job.model_fingerprint(), 1, 0, job.parallel.model_dump()
    )
    manager.maybe_save(1, {"app": ModelOptimizerState([model], [optimizer])}, {"tokens": 32})
    manager.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """A committed checkpoint of MODEL after one AdamW step, and its weights."""
    url = str(tmp_path_factory.mktemp("hf") / "checkpoints")
    return url, train_and_save(JOB, url)


def read_safetensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


def test_export_writes_hf_llama_and_import_restores_identical_weights(
    trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    url, weights = trained
    out = export_hf(url, JOB, tmp_path / "hf", dtype="fp32")
    exported = read_safetensors(out)
    assert {k: tuple(v.shape) for k, v in exported.items()} == HF_SHAPES
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(HF_SHAPES)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_key_value_heads"], config["rope_theta"]) == (64, 2, 5e5)
    # Only q/k rows move (RoPE layout); everything else is the same tensor under its HF name.
    assert torch.equal(
        exported["model.layers.1.mlp.down_proj.weight"], weights["layers.1.feed_forward.w2.weight"]
    )
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"], weights["layers.0.attention.wq.weight"]
    )

    step_url = import_hf(out, JOB, str(tmp_path / "imported"))
    _, model = load_model(step_url, JOB)
    restored = model.state_dict()
    assert set(restored) == set(weights)
    assert all(torch.equal(restored[k], weights[k]) for k in weights)


def test_bf16_export_is_the_cast_weights(
    trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    url, weights = trained
    exported = read_safetensors(export_hf(url, JOB, tmp_path / "hf"))
    head = exported["lm_head.weight"]
    assert head.dtype == torch.bfloat16 and torch.equal(head, weights["output.weight"].bfloat16())


def hf_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' Llama RoPE: cos/sin over cat(freqs, freqs), rotate_half pairs i with i + d/2."""
    seq, half = x.shape[1], x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2).float() / (2 * half))
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None, :, None]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def test_exported_q_k_give_tessera_attention_scores_under_hf_rope(
    trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    url, weights = trained
    exported = read_safetensors(export_hf(url, JOB, tmp_path / "hf", dtype="fp32"))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    rope = Transformer(JOB.model, max_seq_len=16).rope

    def scores(wq: torch.Tensor, wk: torch.Tensor, rotate: object) -> torch.Tensor:
        q = rotate((x @ wq.T).view(2, 16, 4, 16))  # type: ignore[operator]
        k = rotate((x @ wk.T).view(2, 16, 2, 16)).repeat_interleave(2, dim=2)  # type: ignore[operator]
        return torch.einsum("bthd,bshd->bhts", q, k)

    ours = scores(
        weights["layers.0.attention.wq.weight"],
        weights["layers.0.attention.wk.weight"],
        lambda t: apply_rope(t, rope),
    )
    theirs = scores(
        exported["model.layers.0.self_attn.q_proj.weight"],
        exported["model.layers.0.self_attn.k_proj.weight"],
        lambda t: hf_rope(t, 5e5),
    )
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_import_refuses_another_architecture(
    trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    out = export_hf(trained[0], JOB, tmp_path / "hf")
    other = JobConfig.model_validate({"model": {**MODEL, "ffn_dim": 128}, "train": {"seq_len": 16}})
    with pytest.raises(UserError, match=re.escape("model.ffn_dim=128 but intermediate_size=96")):
        import_hf(out, other, str(tmp_path / "imported"))


def test_cli_exports_and_imports(trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"name": "hf", "seed": 3, "model": MODEL, "train": {"seq_len": 16}}))
    out = tmp_path / "hf"
    runner = CliRunner()
    result = runner.invoke(app, ["export", trained[0], str(out), "--spec", str(spec)])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists()
    result = runner.invoke(app, ["import", str(out), str(tmp_path / "back"), "--spec", str(spec)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "back" / "step-000000" / "tessera.json").exists()

    # Without --spec, the model comes from the run directory's run.json; the wrong spec gets advice that fits.
    run_json = Path(trained[0]).parent / "run.json"
    run_json.write_text(json.dumps({"run_id": "hf-0123abcd", "spec": json.loads(spec.read_text())}))
    result = runner.invoke(app, ["export", trained[0], str(tmp_path / "hf-from-run")])
    assert result.exit_code == 0, result.output
    other = tmp_path / "other.yaml"
    other.write_text(json.dumps({"name": "hf", "model": {**MODEL, "n_layers": 1}, "train": {"seq_len": 16}}))
    result = runner.invoke(app, ["export", trained[0], str(tmp_path / "hf-other"), "--spec", str(other)])
    assert result.exit_code == 1 and "export it with the spec it was trained with" in result.output
    assert "checkpoint.url" not in result.output
    run_json.unlink()


def hostile(good: bytes, damage: str) -> bytes:
    """A safetensors file damaged the way an attacker or a broken download would."""
    size = int.from_bytes(good[:8], "little")
    if damage == "header too large":
        return (10**10).to_bytes(8, "little") + good[8:]
    if damage == "invalid JSON in header":
        return (16).to_bytes(8, "little") + b"not json at all!" + good[24:]
    if damage == "incomplete metadata, file not fully covered":
        return good[: len(good) // 2]
    header = json.loads(good[8 : 8 + size])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**9]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + good[8 + size :]


@pytest.mark.parametrize(
    "damage",
    [
        "header too large",
        "invalid JSON in header",
        "incomplete metadata, file not fully covered",
        "invalid shape, data type, or offset for tensor",
    ],
)
def test_a_hostile_or_truncated_safetensors_file_is_one_line_naming_it_and_the_cause(
    trained: tuple[str, dict[str, torch.Tensor]],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    """Not DCP's 'CheckpointException ranks:dict_keys([0])' below a torch traceback."""
    out = export_hf(trained[0], JOB, tmp_path / "hf")
    (weights,) = out.glob("*.safetensors")
    weights.write_bytes(hostile(weights.read_bytes(), damage))
    capfd.readouterr()
    with pytest.raises(UserError) as refused:
        import_hf(out, JOB, str(tmp_path / "imported"))
    assert str(refused.value).startswith(f"cannot read the HF weights in {weights}: {damage}")
    assert "\n" not in str(refused.value) and "Traceback" not in "".join(capfd.readouterr())
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        (b"{not json", "config.json is not JSON: Expecting property name enclosed in double quotes"),
        (b"[1, 2]", "config.json is not a JSON object of model settings, but a list"),
        (None, "config.json: No such file or directory"),
    ],
)
def test_a_malformed_config_json_is_one_line_naming_it(
    trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path, config: bytes | None, refusal: str
) -> None:
    out = export_hf(trained[0], JOB, tmp_path / "hf")
    if config is None:
        (out / "config.json").unlink()
    else:
        (out / "config.json").write_bytes(config)
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"name": "hf", "seed": 3, "model": MODEL, "train": {"seq_len": 16}}))
    result = CliRunner().invoke(app, ["import", str(out), str(tmp_path / "back"), "--spec", str(spec)])
    assert result.exit_code == 1 and refusal in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.slow
def test_export_and_import_print_no_torch_warnings(
    trained: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """A single-process DCP load or save makes torch warn that it assumes a single process: not shown."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"name": "hf", "seed": 3, "model": MODEL, "train": {"seq_len": 16}}))
    out = tmp_path / "hf"
    for args in (["export", trained[0], str(out)], ["import", str(out), str(tmp_path / "back")]):
        done = subprocess.run(
            [sys.executable, "-m", "tessera.cli", *args, "--spec", str(spec)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr


# tiny-moe without its shared expert (Mixtral has none): 2 layers, 8 experts of width 128, top-2.
TINY_MOE = {"preset": "tiny-moe", "moe": {"n_experts": 8, "top_k": 2}}
# Every other layer sparse: layer 0 stays a dense SwiGLU of width 96, layer 1 has 4 experts of width 32.
EVERY_OTHER = {**MODEL, "moe": {"n_experts": 4, "top_k": 2, "every_n_layers": 2, "expert_ffn_dim": 32}}


def mixtral_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers' MixtralForCausalLM names and shapes (dense layers: Llama's mlp), written out by hand."""
    d, f, e = cfg.dim, cfg.expert_ffn_dim, cfg.moe.n_experts  # type: ignore[union-attr]
    kv = cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (cfg.vocab_size, d),
    }
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (d, d),
            f"{layer}.self_attn.k_proj.weight": (kv, d),
            f"{layer}.self_attn.v_proj.weight": (kv, d),
            f"{layer}.self_attn.o_proj.weight": (d, d),
            f"{layer}.input_layernorm.weight": (d,),
            f"{layer}.post_attention_layernorm.weight": (d,),
        }
        if not cfg.is_moe_layer(i):
            f_dense = cfg.ffn_dim
            shapes |= {
                f"{layer}.mlp.gate_proj.weight": (f_dense, d),
                f"{layer}.mlp.up_proj.weight": (f_dense, d),
                f"{layer}.mlp.down_proj.weight": (d, f_dense),
            }
            continue
        shapes[f"{layer}.block_sparse_moe.gate.weight"] = (e, d)
        for j in range(e):
            expert = f"{layer}.block_sparse_moe.experts.{j}"
            shapes |= {
                f"{expert}.w1.weight": (f, d),
                f"{expert}.w3.weight": (f, d),
                f"{expert}.w2.weight": (d, f),
            }
    return shapes


@pytest.mark.parametrize("model", [TINY_MOE, EVERY_OTHER], ids=["tiny-moe", "every_other_layer"])
def test_moe_exports_as_mixtral_and_imports_identical_tensors(model: dict, tmp_path: Path) -> None:
    job = JobConfig.model_validate({"seed": 5, "model": model, "train": {"seq_len": 16}})
    weights = train_and_save(job, str(tmp_path / "checkpoints"))
    out = export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf", dtype="fp32")
    exported = read_safetensors(out)
    assert {k: tuple(v.shape) for k, v in exported.items()} == mixtral_shapes(job.model)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    moe = job.model.moe
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (moe.n_experts, moe.top_k)
    assert config["intermediate_size"] == job.model.expert_ffn_dim
    assert config["router_aux_loss_coef"] == moe.aux_loss_coef
    assert config.get("decoder_sparse_step", 1) == moe.every_n_layers
    # Expert j of a layer is row j of tessera's stacked weight, as an [out, in] nn.Linear weight.
    last = job.model.n_layers - 1
    for j in range(moe.n_experts):
        for w in ("w1", "w2", "w3"):
            assert torch.equal(
                exported[f"model.layers.{last}.block_sparse_moe.experts.{j}.{w}.weight"],
                weights[f"layers.{last}.feed_forward.experts.{w}"][j].T,
            )

    _, restored = load_model(import_hf(out, job, str(tmp_path / "imported")), job)
    state = restored.state_dict()
    assert set(state) == set(weights)
    assert all(torch.equal(state[k], weights[k]) for k in weights)


def test_mixtral_block_computed_from_the_export_is_tesseras_moe_layer(tmp_path: Path) -> None:
    """transformers' MixtralSparseMoeBlock, written out: softmax router, top-k, weights renormalized,
    sum of w2(silu(w1 x) * w3 x) over the chosen experts."""
    job = JobConfig.model_validate({"seed": 5, "model": TINY_MOE, "train": {"seq_len": 16}})
    weights = train_and_save(job, str(tmp_path / "checkpoints"))
    exported = read_safetensors(export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf", dtype="fp32"))
    model = Transformer(job.model, max_seq_len=16)
    model.load_state_dict(weights)
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(1))
    block = "model.layers.0.block_sparse_moe"
    probs = (x @ exported[f"{block}.gate.weight"].T).softmax(-1)
    top, chosen = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    theirs = torch.zeros_like(x)
    for j in range(8):
        w1, w2, w3 = (exported[f"{block}.experts.{j}.{w}.weight"] for w in ("w1", "w2", "w3"))
        out = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        theirs += out * (top * (chosen == j)).sum(-1, keepdim=True)
    torch.testing.assert_close(theirs, model.layers["0"].feed_forward(x), rtol=1e-5, atol=1e-6)


def test_moe_conversion_refuses_shared_experts_and_other_architectures(tmp_path: Path) -> None:
    shared = JobConfig.model_validate({"model": {"preset": "tiny-moe"}, "train": {"seq_len": 16}})
    with pytest.raises(
        UserError, match=re.escape("model.moe.shared_experts=1: Mixtral has no shared experts")
    ):
        export_hf(str(tmp_path / "none"), shared, tmp_path / "hf")
    job = JobConfig.model_validate({"seed": 5, "model": TINY_MOE, "train": {"seq_len": 16}})
    train_and_save(job, str(tmp_path / "checkpoints"))
    out = export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf")
    fewer = JobConfig.model_validate(
        {"model": {"preset": "tiny-moe", "moe": {"n_experts": 4, "top_k": 2}}, "train": {"seq_len": 16}}
    )
    with pytest.raises(UserError, match=re.escape("model.moe.n_experts=4 but num_local_experts=8")):
        import_hf(out, fewer, str(tmp_path / "imported"))
    with pytest.raises(UserError, match="model_type 'mixtral' but the spec's model is llama"):
        import_hf(out, JOB, str(tmp_path / "imported"))


def test_bias_balanced_models_import_with_zero_biases_and_refuse_export(tmp_path: Path) -> None:
    job = JobConfig.model_validate({"seed": 5, "model": TINY_MOE, "train": {"seq_len": 16}})
    weights = train_and_save(job, str(tmp_path / "checkpoints"))
    out = export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf", dtype="fp32")
    biased = JobConfig.model_validate(
        {"model": {**TINY_MOE, "moe": {**TINY_MOE["moe"], "balance": "bias"}}, "train": {"seq_len": 16}}
    )
    step_url = import_hf(out, biased, str(tmp_path / "imported"))
    _, model = load_model(step_url, biased)
    state = model.state_dict()
    assert torch.equal(state["layers.1.feed_forward.experts.w2"], weights["layers.1.feed_forward.experts.w2"])
    assert torch.equal(state["layers.1.feed_forward.router.expert_bias"], torch.zeros(8))
    with pytest.raises(UserError, match=re.escape("model.moe.balance='bias'")):
        export_hf(step_url, biased, tmp_path / "again")


# DeepSeek: a V3-style model (low-rank query, sigmoid router with its bias, first layer dense) and a
# V2-Lite-style one (plain query, softmax router, weights not normalised, no bias).
DEEPSEEK_V3 = dict(
    preset="deepseek-custom",
    n_layers=3,
    dim=32,
    n_heads=2,
    n_kv_heads=2,
    ffn_dim=48,
    vocab_size=64,
    rope_theta=1e4,
    mla=dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    moe=dict(
        n_experts=4,
        top_k=2,
        shared_experts=1,
        expert_ffn_dim=12,
        first_dense_layers=1,
        score="sigmoid",
        routed_scale=2.5,
        balance="bias",
        bias_update_rate=0.05,
    ),
)
DEEPSEEK_V2 = {
    **DEEPSEEK_V3,
    "mla": {**DEEPSEEK_V3["mla"], "q_lora_rank": None},
    "moe": dict(
        n_experts=4,
        top_k=2,
        shared_experts=2,
        expert_ffn_dim=12,
        first_dense_layers=1,
        normalize_weights=False,
    ),
}


def deepseek_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers' DeepseekV3/V2ForCausalLM names and shapes, written out by hand."""
    d, mla, moe, heads = cfg.dim, cfg.mla, cfg.moe, cfg.n_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (cfg.vocab_size, d),
    }
    for i in range(cfg.n_layers):
        layer = f"model.layers.{i}"
        attn = f"{layer}.self_attn"
        if mla.q_lora_rank is None:
            shapes[f"{attn}.q_proj.weight"] = (heads * qk, d)
        else:
            shapes |= {
                f"{attn}.q_a_proj.weight": (mla.q_lora_rank, d),
                f"{attn}.q_a_layernorm.weight": (mla.q_lora_rank,),
                f"{attn}.q_b_proj.weight": (heads * qk, mla.q_lora_rank),
            }
        shapes |= {
            f"{attn}.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, d),
            f"{attn}.kv_a_layernorm.weight": (mla.kv_lora_rank,),
            f"{attn}.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            f"{attn}.o_proj.weight": (d, heads * mla.v_head_dim),
            f"{layer}.input_layernorm.weight": (d,),
            f"{layer}.post_attention_layernorm.weight": (d,),
        }
        if i < moe.first_dense_layers:
            f = cfg.ffn_dim
            shapes |= {
                f"{layer}.mlp.{p}.weight": (d, f) if p == "down_proj" else (f, d)
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            continue
        shapes[f"{layer}.mlp.gate.weight"] = (moe.n_experts, d)
        if moe.score == "sigmoid":
            shapes[f"{layer}.mlp.gate.e_score_correction_bias"] = (moe.n_experts,)
        f = moe.expert_ffn_dim
        for prefix, width in [(f"experts.{j}", f) for j in range(moe.n_experts)] + [
            ("shared_experts", f * moe.shared_experts)
        ]:
            shapes |= {
                f"{layer}.mlp.{prefix}.gate_proj.weight": (width, d),
                f"{layer}.mlp.{prefix}.up_proj.weight": (width, d),
                f"{layer}.mlp.{prefix}.down_proj.weight": (d, width),
            }
    return shapes


@pytest.mark.parametrize(
    ("model", "model_type"),
    [(DEEPSEEK_V3, "deepseek_v3"), (DEEPSEEK_V2, "deepseek_v2")],
    ids=["v3", "v2_lite"],
)
def test_deepseek_exports_under_its_hf_names_and_imports_identical_tensors(
    model: dict, model_type: str, tmp_path: Path
) -> None:
    job = JobConfig.model_validate({"seed": 5, "model": model, "train": {"seq_len": 16}})
    weights = train_and_save(job, str(tmp_path / "checkpoints"))
    out = export_hf(str(tmp_path / "checkpoints"), job, tmp_path / "hf", dtype="fp32")
    exported = read_safetensors(out)
    assert {k: tuple(v.shape) for k, v in exported.items()} == deepseek_shapes(job.model)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["first_k_dense_replace"] == 1
    # Names only: the released shapes, splits and (adjacent-pair) RoPE layout are tessera's.
    assert torch.equal(
        exported["model.layers.2.self_attn.kv_b_proj.weight"], weights["layers.2.attention.wkv_b.weight"]
    )
    assert torch.equal(
        exported["model.layers.1.mlp.experts.3.down_proj.weight"],
        weights["layers.1.feed_forward.experts.w2"][3].T,
    )
    if model_type == "deepseek_v3":
        bias = weights["layers.1.feed_forward.router.expert_bias"]
        assert bias.abs().sum() > 0, "the step moved the routing bias"
        assert torch.equal(exported["model.layers.1.mlp.gate.e_score_correction_bias"], bias)
    _, restored = load_model(import_hf(out, job, str(tmp_path / "imported")), job)
    state = restored.state_dict()
    assert set(state) == set(weights)
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    # The exported config.json reads back as the same model.
    assert ModelConfig(**deepseek_hf.model_fields(config)).model_dump() == {
        **job.model.model_dump(),
        "moe": {
            **job.model.moe.model_dump(),
            "bias_update_rate": 0.001 if model_type == "deepseek_v3" else None,
        },
    }


# The released config.json files' architecture keys (huggingface.co/deepseek-ai/DeepSeek-V3 and
# DeepSeek-V2-Lite), as the presets cite them.
RELEASED_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "intermediate_size": 18432,
    "vocab_size": 129280,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "aux_loss_alpha": 0.001,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
}
RELEASED_V2_LITE = {
    "model_type": "deepseek_v2",
    "num_hidden_layers": 27,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 10944,
    "vocab_size": 102400,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "aux_loss_alpha": 0.001,
}


@pytest.mark.parametrize(
    ("config", "preset"),
    [(RELEASED_V3, "deepseek-v3"), (RELEASED_V2_LITE, "deepseek-v2-lite")],
    ids=["v3", "v2_lite"],
)
def test_the_architecture_of_a_released_config_is_the_preset(config: dict, preset: str) -> None:
    fields = ModelConfig(**deepseek_hf.architecture(config)).model_dump()
    ours = ModelConfig(preset=preset).model_dump()
    assert fields["preset"] == "deepseek-custom"
    assert {k: v for k, v in fields.items() if k not in ("preset", "moe")} == {
        k: v for k, v in ours.items() if k not in ("preset", "moe")
    }
    # The preset takes the paper's balance-loss weight for V3 (1e-4); the file's aux_loss_alpha is 0.001.
    assert {k: v for k, v in fields["moe"].items() if k != "aux_loss_coef"} == {
        k: v for k, v in ours["moe"].items() if k != "aux_loss_coef"
    }


def test_deepseek_conversion_refuses_what_transformers_would_compute_differently(tmp_path: Path) -> None:
    every_other = JobConfig.model_validate(
        {
            "model": {**DEEPSEEK_V3, "moe": {**DEEPSEEK_V3["moe"], "every_n_layers": 2}},
            "train": {"seq_len": 16},
        }
    )
    with pytest.raises(UserError, match=re.escape("model.moe.every_n_layers=2")):
        export_hf(str(tmp_path / "none"), every_other, tmp_path / "hf")
    softmax_bias = JobConfig.model_validate(
        {
            "model": {**DEEPSEEK_V3, "moe": {**DEEPSEEK_V3["moe"], "score": "softmax"}},
            "train": {"seq_len": 16},
        }
    )
    with pytest.raises(UserError, match=re.escape("model.moe.balance='bias' with score='softmax'")):
        export_hf(str(tmp_path / "none"), softmax_bias, tmp_path / "hf")
    v3 = JobConfig(model={"preset": "deepseek-v3"})
    with pytest.raises(UserError, match=r"rope_scaling=.*; n_group=8, topk_group=4: group-limited routing"):
        deepseek_hf.check_hf_config(RELEASED_V3, v3.model)
    with pytest.raises(UserError, match=re.escape("model.n_layers=3 but config.json gives 61")):
        deepseek_hf.check_hf_config(
            {**RELEASED_V3, "rope_scaling": None, "n_group": 1}, JobConfig(model=DEEPSEEK_V3).model
        )
    with pytest.raises(
        UserError, match="model_type 'llama'; the DeepSeek family reads deepseek_v3, deepseek_v2"
    ):
        deepseek_hf.model_fields({"model_type": "llama"})


def test_model_fields_refuse_what_the_released_v3_computes_and_tessera_does_not() -> None:
    """model.from_hf builds the model the file describes or refuses: the released V3's YaRN scaling and
    group-limited routing are named, with the preset that is the architecture without them."""
    with pytest.raises(UserError) as refused:
        deepseek_hf.model_fields(RELEASED_V3)
    message = str(refused.value)
    assert "rope_scaling={'type': 'yarn'" in message and "n_group=8, topk_group=4" in message, message
    assert "model.preset: deepseek-v3" in message
    transformers5 = {k: v for k, v in RELEASED_V3.items() if k not in ("rope_scaling", "n_group")}
    transformers5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000, "factor": 40}
    with pytest.raises(UserError, match=r"rope_scaling=.*'rope_type': 'yarn'"):
        deepseek_hf.model_fields(transformers5)
    plain = {**transformers5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000}}
    assert deepseek_hf.model_fields(plain) == deepseek_hf.architecture(plain)

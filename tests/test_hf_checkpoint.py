"""Hugging Face export/import: a real tessera checkpoint → safetensors in HF Llama naming → back.

The checkpoint is written by the trainer's own CheckpointManager after a real optimizer step; export
and import go through DCP's HuggingFaceStorageWriter/Reader and real files. No hub is contacted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from tessera.cli import app
from trainer.checkpoint import CheckpointManager, ModelOptimizerState
from trainer.checkpoint.hf import export_hf, import_hf
from trainer.config import CheckpointConfig, JobConfig
from trainer.evaluate import load_model
from trainer.failures import UserError
from trainer.model import Transformer, apply_rope

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


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """A committed checkpoint of MODEL after one AdamW step, and its weights."""
    model = Transformer(JOB.model, max_seq_len=16)
    model.init_weights(JOB.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(128, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    url = str(tmp_path_factory.mktemp("hf") / "checkpoints")
    manager = CheckpointManager(
        url, CheckpointConfig(mode="sync"), 1, JOB.model_fingerprint(), 1, 0, JOB.parallel.model_dump()
    )
    manager.maybe_save(1, {"app": ModelOptimizerState([model], [optimizer])}, {"tokens": 32})
    manager.close()
    return url, {k: v.detach().clone() for k, v in model.state_dict().items()}


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

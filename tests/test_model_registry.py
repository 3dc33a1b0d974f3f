"""Model families: Llama is registered as one, and a second family registered from a test trains under
FSDP (real torchrun, 2 gloo ranks) exactly like its single-process reference, touching no core file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.torchrun import run_torchrun
from trainer.config import ModelConfig
from trainer.models import family_of, register
from trainer.models.llama import LLAMA

FP32_RTOL = 1e-4  # FSDP differs from the reference only in reduction order


def test_every_builtin_preset_and_custom_is_a_llama() -> None:
    for preset in ("tiny", "tiny-moe", "llama3-8b", "mixtral-8x7b"):
        assert family_of(ModelConfig(preset=preset)) is LLAMA
    custom = ModelConfig(
        preset="custom", n_layers=1, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=8, vocab_size=8, rope_theta=1e4
    )
    assert family_of(custom) is LLAMA


def test_a_family_or_preset_registers_once_and_an_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(LLAMA)
    with pytest.raises(ValidationError, match=r"unknown model\.preset 'llama9'; use one of tiny, small"):
        ModelConfig(preset="llama9")


@pytest.mark.dist
def test_a_family_registered_outside_the_trainer_trains_under_fsdp_like_its_reference(tmp_path: Path) -> None:
    out = tmp_path / "toy.json"
    run_torchrun(["-m", "tests.dist.toy_family", str(out)], nproc=2)
    result = json.loads(out.read_text())
    fsdp, reference = result["fsdp"], result["reference"]
    assert "MLPModel" in fsdp["module"], "the toy family's module, not Llama's, was built"
    assert reference[-1] < reference[0] / 2, "the reference must actually train"
    assert fsdp["loss"] == pytest.approx(reference, rel=FP32_RTOL)
    assert fsdp["stored"] == pytest.approx(0.5, abs=0.01), "each of 2 ranks holds half the parameters"

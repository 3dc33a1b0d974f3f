"""Document masking (model.attention=document): against an explicit mask, documents run alone, and causal."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.nn.attention.flex_attention import flex_attention

from trainer.backends.chips import get_chip
from trainer.config import LATER_MODEL_DEFAULTS, JobConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.models.documents import document_attention, document_block_mask, find_documents
from trainer.models.llama.model import Transformer
from trainer.plan.compute import block_attention_seconds
from trainer.plan.hbm import estimate_memory
from trainer.plan.layout import Geometry
from trainer.plan.profile import catalog_profile
from trainer.rank.loss import token_loss

EOS = 0
DIMS = dict(
    preset="custom", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=96, rope_theta=1e4
)
SEQ = 32


def model(attention: str = "causal", rope_positions: str = "sequence", seed: int = 0) -> Transformer:
    cfg = ModelConfig(**DIMS, attention=attention, rope_positions=rope_positions)
    built = Transformer(cfg, max_seq_len=SEQ)
    built.init_weights(seed)
    built.eos_id = EOS
    return built


def packed(rows: int, seed: int, eos_every: int | None = 7) -> torch.Tensor:
    """[rows, SEQ + 1] ids without EOS, then EOS at random places (about one per eos_every tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, DIMS["vocab_size"], (rows, SEQ + 1), generator=generator)
    if eos_every is not None:
        ids[torch.rand(ids.shape, generator=generator) < 1 / eos_every] = EOS
    return ids


def explicit_mask(tokens: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T], written out by hand: query i sees keys from just after the last EOS before it up to i."""
    batch, seq = tokens.shape
    mask = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
    for b in range(batch):
        start = 0
        for i in range(seq):
            mask[b, 0, i, start : i + 1] = True
            if tokens[b, i] == EOS:
                start = i + 1
    return mask


def test_a_document_ends_with_its_eos_and_positions_restart_after_it() -> None:
    docs = find_documents(torch.tensor([[5, 0, 7, 8, 0, 9, 3, 0]]), EOS)
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    assert torch.equal(docs.dense, explicit_mask(torch.tensor([[5, 0, 7, 8, 0, 9, 3, 0]])))
    # Without an end-of-text id (synthetic tokens) a row is one document: plain causal attention.
    alone = find_documents(torch.tensor([[5, 0, 7]]), None)
    assert alone.positions.tolist() == [[0, 1, 2]] and torch.equal(
        alone.dense[0, 0], torch.ones(3, 3).tril().bool()
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_block_mask_gives_the_explicit_masks_attention() -> None:
    """The mask CUDA trains with, run forward on CPU (flex has no CPU backward): 3×3 blocks of 128, most
    skipped, against SDPA with the hand-written mask."""
    tokens = packed(2, seed=1, eos_every=40).repeat(1, 12)[:, :384]
    q = torch.randn(2, 4, 384, 16)
    k, v = torch.randn(2, 2, 384, 16), torch.randn(2, 2, 384, 16)
    ids = (torch.cat((torch.zeros(2, 1), (tokens[:, :-1] == EOS).float()), 1).cumsum(1)).int()
    flex = flex_attention(q, k, v, block_mask=document_block_mask(ids), enable_gqa=True)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=explicit_mask(tokens), enable_gqa=True)
    torch.testing.assert_close(flex, reference, rtol=1e-5, atol=1e-5)
    q.requires_grad_()
    dense = document_attention(q, k, v, find_documents(tokens, EOS))  # the CPU kernel, with a backward
    torch.testing.assert_close(dense, reference)


def test_outputs_and_gradients_match_sdpa_with_an_explicit_block_diagonal_mask() -> None:
    documents, reference = model("document"), model("causal")
    ids = packed(3, seed=2)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = explicit_mask(inputs)
    for block in reference.layers.values():  # the causal model with every layer's attention masked by hand
        block.attention.attend = lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        )
    for built in (documents, reference):
        built(inputs, targets).backward()
    torch.testing.assert_close(documents(inputs), reference(inputs))
    for (name, got), (_, want) in zip(
        documents.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_with_document_positions_each_document_trains_as_if_alone() -> None:
    """Packed loss and gradients equal the token-weighted sum over the documents run one by one."""
    packed_model, alone = model("document", "document"), model("causal")
    row = torch.tensor([[3, 4, 5, 0, 9, 10, 11, 12, 0, 7, 8, 9, 10]])
    inputs, targets = row[:, :-1], row[:, 1:]
    packed_model(inputs, targets).backward()
    total = inputs.numel()
    for start, end in ((0, 4), (4, 9), (9, 12)):  # each document with its EOS
        (alone(inputs[:, start:end], targets[:, start:end]) * (end - start) / total).backward()
    with torch.no_grad():
        first_alone = alone(inputs[:, 4:9])
    torch.testing.assert_close(packed_model(inputs)[:, 4:9], first_alone)
    for (name, got), (_, want) in zip(packed_model.named_parameters(), alone.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def loss_curve(attention: str, rows: torch.Tensor, steps: int = 6) -> list[float]:
    built = model(attention, "document" if attention == "document" else "sequence")
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-2)
    curve = []
    for step in range(steps):
        batch = rows[4 * step : 4 * step + 4]
        loss = token_loss(built(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(loss.item())
    return curve


def test_a_loss_curve_differs_from_causal_on_packed_data_and_matches_it_with_one_document_per_sample() -> (
    None
):
    documents = packed(24, seed=3)
    assert loss_curve("document", documents) != pytest.approx(loss_curve("causal", documents), rel=1e-3)
    one_each = packed(24, seed=3, eos_every=None)
    one_each[:, -2] = EOS  # the last input ends the sample's only document
    assert loss_curve("document", one_each) == pytest.approx(loss_curve("causal", one_each), rel=1e-5)


def test_rope_positions_per_document_need_document_attention() -> None:
    with pytest.raises(
        ValidationError, match=r"model.rope_positions=document needs model.attention=document"
    ):
        ModelConfig(preset="tiny", rope_positions="document")


@pytest.mark.parametrize(
    ("parallel", "refusal"),
    [
        (
            {"cp": 2},
            r"model.attention=document with parallel.cp=2 .*set parallel.cp=1 or model.attention=causal",
        ),
        (
            {"pp": 2},
            r"model.attention=document with parallel.pp=2 .*set parallel.pp=1 or model.attention=causal",
        ),
    ],
)
def test_context_and_pipeline_parallelism_are_refused_naming_the_fix(parallel: dict, refusal: str) -> None:
    with pytest.raises(ValidationError, match=refusal):
        JobConfig(
            model={"preset": "tiny", "attention": "document"},
            parallel=parallel,
            hardware={"chips_per_node": 2},
            train={"global_batch_size": 8, "micro_batch_size": 2},
        )


def test_the_fingerprint_of_a_causal_model_is_the_one_its_checkpoints_carry() -> None:
    causal = JobConfig()
    before_the_fields = {k: v for k, v in causal.model.model_dump().items() if k not in LATER_MODEL_DEFAULTS}
    legacy = hashlib.sha256(json.dumps(before_the_fields, sort_keys=True).encode()).hexdigest()[:16]
    assert causal.model_fingerprint() == legacy
    assert JobConfig(model={"attention": "document"}).model_fingerprint() != legacy


@pytest.mark.parametrize(
    ("accelerator", "chip", "attention_factor"), [("cpu", "cpu", 2.0), ("gpu", "h100-sxm", 1.0)]
)
def test_the_planner_prices_the_dense_mask_off_gpus_and_flex_as_causal_on_them(
    accelerator: str, chip: str, attention_factor: float
) -> None:
    train = TrainConfig(seq_len=1024, global_batch_size=4, micro_batch_size=2)
    causal, document = (
        Geometry(ModelConfig(preset="tiny", attention=attention), ParallelConfig(), train, accelerator)
        for attention in ("causal", "document")
    )
    hw = catalog_profile(get_chip(chip))
    assert block_attention_seconds(document, hw) == pytest.approx(
        attention_factor * block_attention_seconds(causal, hw)
    )
    mask_bytes = 2 * 1024**2 if accelerator == "cpu" else 0  # one bool per (query, key) of a micro-batch
    assert estimate_memory(document).buffers - estimate_memory(causal).buffers == mask_bytes

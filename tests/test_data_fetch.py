"""The loader against a slow, flaky ``s3://``: shards fetched ahead, retried, and cached on local disk."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.bench_data import LatencyProxy
from tests.stores import _clear_fsspec_cache
from trainer.config import DataConfig, JobConfig, ModelConfig, TrainConfig
from trainer.data import build_loader, prepare_dataset, read_card
from trainer.storage import remove

pytestmark = pytest.mark.store

VOCAB, SEQ, BATCH, STEPS = 512, 32, 16, 12
LATENCY_S = 0.1


@pytest.fixture
def slow_s3(_moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[LatencyProxy]:
    """Every request to S3 100 ms late, and every 7th answered 503 (the client does not retry them)."""
    proxy = LatencyProxy(_moto_endpoint, LATENCY_S, fail_every=7)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _clear_fsspec_cache()
    yield proxy
    _clear_fsspec_cache()
    proxy.shutdown()
    proxy.server_close()
    thread.join()


def read(data_url: str) -> list[torch.Tensor]:
    job = JobConfig(
        data_url=data_url,
        loader_workers=0,
        model=ModelConfig(preset="tiny", vocab_size=VOCAB),
        train=TrainConfig(seq_len=SEQ, global_batch_size=BATCH, micro_batch_size=1),
    )
    loader = build_loader(job, 0, 1)
    batches = [next(loader)[0] for _ in range(STEPS)]
    loader.close()
    return batches


def test_prefetch_retry_and_cache_under_latency(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    cfg = DataConfig(source="generated", max_documents=200, samples_per_shard=20)
    local = prepare_dataset(cfg.model_copy(update={"output_url": str(tmp_path / "local")}), VOCAB, SEQ, 0)
    remote = prepare_dataset(cfg.model_copy(update={"output_url": f"{s3_bucket}/fetch"}), VOCAB, SEQ, 0)
    want = read(local)
    shard = max(s.bytes for s in read_card(local).shards)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TESSERA_DATA_PREFETCH", "3")
    monkeypatch.setenv("TESSERA_DATA_CACHE_DIR", str(cache))
    monkeypatch.setenv("TESSERA_DATA_CACHE_GB", str(4 * shard / 1e9))  # room for four shards

    proxy = request.getfixturevalue("slow_s3")
    assert all(torch.equal(a, b) for a, b in zip(read(remote), want, strict=True))
    assert proxy.failures >= 1  # 503s were retried with backoff, not surfaced
    assert proxy.max_in_flight >= 2  # shards were fetched ahead, concurrently
    # a closed loader leaves no download running that could still write (and evict) in the cache
    assert not [t for t in threading.enumerate() if t.name.startswith("shard-prefetch")]
    cached = list(cache.glob("*.tar"))
    assert 0 < len(cached) <= 4 and sum(p.stat().st_size for p in cached) <= 4 * shard

    monkeypatch.setenv("TESSERA_DATA_CACHE_GB", "1")
    read(remote)  # fills the cache with every shard the steps touch
    remove(f"{s3_bucket}/fetch/parts", recursive=True)  # from now on, shards come from the cache or nowhere
    assert all(torch.equal(a, b) for a, b in zip(read(remote), want, strict=True))

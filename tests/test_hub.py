"""No hub at run time, the user's stores always (trainer/hub.py).

Run in a fresh interpreter that inherits this test's environment, i.e. the one ``make test`` and
``tessera run`` give, plus the offline switches a user may have exported (the Makefile once did, and
datasets 5 then refused every s3:// corpus). The hub endpoint points at a local socket that counts
connections, so "nothing reached the hub" is observed, not assumed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from trainer.config import DataConfig

pytestmark = pytest.mark.store

USER_EXPORTS = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
PREPARE_THEN_ASK_THE_HUB = """
import json, sys
from trainer.config import DataConfig
from trainer.data import prepare_dataset, read_card

corpus, output = sys.argv[1:]
cfg = DataConfig(source="files", paths=[corpus], output_url=output, samples_per_shard=30)
totals = read_card(prepare_dataset(cfg, 512, 32, seed=0)).totals
outcome = {"documents": totals["train"].documents + totals["val"].documents}

import datasets, huggingface_hub
for name, ask in {
    "model": lambda: huggingface_hub.HfApi().model_info("gpt2"),
    "dataset": lambda: datasets.load_dataset("tessera-test/not-on-any-hub", split="train"),
}.items():
    try:
        ask()
        outcome[name] = "answered"
    except Exception as error:
        outcome[name] = type(error).__name__
print(json.dumps(outcome))
"""


class FakeHub:
    """A listening socket standing in for the hub: it accepts, counts and closes every connection."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            connection.close()


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub()
    yield hub
    hub.server.close()


def test_s3_corpus_reads_and_the_hub_stays_shut(s3_bucket: str, fake_hub: FakeHub, tmp_path: Path) -> None:
    corpus = f"{s3_bucket}/hub-test/docs.jsonl"
    with fsspec.open(corpus, "w") as f:
        f.writelines(json.dumps({"text": f"document {i}: " + "lorem ipsum " * 30}) + "\n" for i in range(30))
    # A cache of its own, so that datasets must read the corpus from the store.
    env = os.environ | USER_EXPORTS | {"HF_ENDPOINT": fake_hub.url, "HF_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", PREPARE_THEN_ASK_THE_HUB, corpus, f"{s3_bucket}/hub-test/out"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["documents"] == 30
    assert outcome["model"] == "OfflineModeIsEnabled"
    assert outcome["dataset"] != "answered"
    assert fake_hub.connections == 0


@pytest.mark.parametrize(
    "url", ["hf://datasets/org/name/train.jsonl", "https://huggingface.co/datasets/org/x"]
)
def test_hub_paths_are_refused_by_the_spec(url: str) -> None:
    with pytest.raises(ValueError, match=r"is on the Hugging Face Hub.*list that in data.paths"):
        DataConfig(source="files", paths=[url])

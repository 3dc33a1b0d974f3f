"""Checkpoints on an object store that misbehaves: moto's S3 server behind a proxy that answers every
Nth request with a 503 or a dropped connection (retried, nothing lost), or 403 to every request (one
line naming the URL, not retried as infrastructure)."""

from __future__ import annotations

import errno
import traceback
from typing import Literal

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.dist.ckpt_common import JOB, Trainee
from tests.fault_report import FaultRow, record
from tests.stores import FlakyStore
from trainer.checkpoint import CheckpointManager, CheckpointStoreError, list_checkpoints
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.store import dcp_errors
from trainer.config import CheckpointConfig
from trainer.failures import is_infra_error

pytestmark = [pytest.mark.store, pytest.mark.fault]


def manager(url: str, mode: str = "sync") -> CheckpointManager:
    return CheckpointManager(url, CheckpointConfig(mode=mode), 1, JOB.model_fingerprint(), 1, 0, {})


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_save_and_resume_ride_out_store_errors(
    fault: Literal["503", "reset"], flaky_s3_bucket: FlakyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")  # the fixture turns client retries off; checkpoints rely on them
    flaky_s3_bucket.proxy.fail_every, flaky_s3_bucket.proxy.fault = 8, fault
    url = f"{flaky_s3_bucket.url}/ckpt-{fault}"
    trainee = Trainee(world=1, rank=0)
    saver = manager(url, mode="async")
    for step in (1, 2):
        trainee.step()
        saver.maybe_save(step, trainee.state(), {"tokens": step})
    saver.close()
    saved_failures = flaky_s3_bucket.proxy.failures
    assert [(m.step, m.status) for m in list_checkpoints(url)] == [(1, "committed"), (2, "committed")]

    resumed = Trainee(world=1, rank=0)
    restored = manager(url).restore(resumed.state())
    assert restored is not None and restored.step == 2
    for name, value in trainee.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert saved_failures > 0 and flaky_s3_bucket.proxy.failures > saved_failures  # both ways hit 503s
    record(
        FaultRow(
            f"checkpoint store fails every 8th request with {fault} ({flaky_s3_bucket.proxy.failures} in all)",
            "recovered",
            "retried per request",
            None,
            0,
            None,
            None,
        )
    )


def test_denied_requests_are_one_line_naming_the_url_and_not_retried(flaky_s3_bucket: FlakyStore) -> None:
    url = f"{flaky_s3_bucket.url}/ckpt-403"
    saver = manager(url)
    trainee = Trainee(world=1, rank=0)
    trainee.step()
    flaky_s3_bucket.proxy.fail_every, flaky_s3_bucket.proxy.fault = 1, "403"
    with pytest.raises(CheckpointStoreError) as error:
        saver.maybe_save(1, trainee.state(), {"tokens": 1})
    message = str(error.value)
    assert f"{url}/step-000001" in message and "PermissionError" in message, message
    assert "\n" not in message
    assert not is_infra_error(error.value)  # a retry would be denied the same way
    record(
        FaultRow(
            "checkpoint store denies every request (403)",
            "failed clearly",
            "user_error",
            None,
            None,
            None,
            None,
        )
    )


@pytest.mark.parametrize(
    "cause",
    [
        OSError(errno.ENOSPC, "No space left on device", "/ckpt/__0_0.distcp"),
        # torch's zip writer, where the disk fills in the middle of a file
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    ],
)
def test_a_full_disk_is_one_line_saying_so_whichever_writer_found_it(cause: BaseException) -> None:
    failure = CheckpointException("save failed", {0: (cause, traceback.extract_stack())})
    with pytest.raises(CheckpointError) as raised, dcp_errors("saving", "/ckpt/step-2"):
        raise failure
    message = str(raised.value)
    assert "out of space (" in message and "No space left on device" in message, message
    assert "checkpoint.keep_last + 1 checkpoints" in message and "unexpected pos" not in message

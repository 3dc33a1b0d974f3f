"""A spec the server accepts but the flow refuses is one line in the flow run's log, no traceback
(through the real server and worker: tests/test_e2e.py)."""

from __future__ import annotations

import logging
import sys

import pytest
from prefect.exceptions import ParameterTypeError

from flows.pipeline import train_pipeline
from tasks.logs import OneLineSpecRefusals


def refusal(spec: dict[str, object]) -> ParameterTypeError:
    """What Prefect's engine raises when it validates a flow run's parameters."""
    with pytest.raises(ParameterTypeError) as refused:
        train_pipeline.validate_parameters({"spec": spec})
    return refused.value


def record(
    error: BaseException, message: str = "Engine execution exited with unexpected exception"
) -> logging.LogRecord:
    try:
        raise error
    except type(error):
        exc_info = sys.exc_info()
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, message, (), exc_info)


def test_a_refused_spec_is_logged_as_one_line_without_a_traceback() -> None:
    error = refusal({"parallel": {"dp_shard": 3}, "cluster": {"chips_per_node": 2}, "train": {"steps": 0}})
    line = record(error)
    assert OneLineSpecRefusals().filter(line) and line.exc_info is None
    message = line.getMessage()
    assert message.startswith("spec is invalid: ") and "\n" not in message
    assert "train.steps: Input should be greater than or equal to 1" in message
    other = record(RuntimeError("boom"))  # any other failure keeps its traceback
    assert OneLineSpecRefusals().filter(other) and other.exc_info is not None

"""Record which running task produced an input, without waiting for it to finish.

Prefect draws a task's upstream edges from the futures and task results passed to it. A checkpoint
the trainer committed is read from storage as a plain URL while the train task is still running, so
the graph would show validate → evaluate floating free of training; passing the train future instead
would block until training ends. The task runner's ``dependencies`` adds the edge to the new task
run's inputs and waits for nothing, so the graph shows the pipeline as declared.
"""

from __future__ import annotations

from typing import Any, TypeVar

from prefect import Task
from prefect.client.schemas.objects import TaskRunResult
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture

R = TypeVar("R")


def submit_produced_by(
    task: Task[..., R], producer: PrefectFuture[Any], produced: str, **parameters: Any
) -> PrefectFuture[R]:
    """``task.submit(**parameters)``, recording ``producer`` as the source of input ``produced``."""
    context = FlowRunContext.get()
    if context is None or context.task_runner is None:
        raise RuntimeError(f"{task.name}: submit_produced_by runs inside a flow")
    edge = {produced: {TaskRunResult(id=producer.task_run_id)}}
    return context.task_runner.submit(task, parameters, dependencies=edge)

"""A cancelled flow run reaches Cancelled as soon as its tear-down is done, and its log says so.

A process worker (Prefect's runner) starts each flow run with
``PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS=false``: on a cancel it sends the flow run's process
SIGTERM, and Prefect's engine in there runs the flow's ``finally`` blocks (our tear-down stops the
torchrun agents, which checkpoint the step they are on), logs "Flow run was cancelled." and then
"Finished in state Running()", because the worker, not the engine, sets the final state. The worker
sets Cancelled only once it sees the whole process group gone, polling every 3 s within a 30 s grace,
so a cancelled run sat at "Cancelling" for 20-60 s after everything had stopped.

With the engine owning cancellation again (the variable set back to ``true`` in the flow run's own
process, before the engine reads it on the SIGTERM), the engine moves the run through Cancelling to
Cancelled itself right after tear-down and its last log line is "Finished in state Cancelled(...)".
The worker still waits for the process and then finds the run already Cancelled (it accepts that).
The run has no cancellation or crash hooks, the one other thing this variable decides.
"""

from __future__ import annotations

import os

ENGINE_OWNS_CANCELLATION = "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS"


def engine_owned_cancellation() -> None:
    """Let the flow run's engine set its own Cancelled state (call at import of the flow module)."""
    os.environ[ENGINE_OWNS_CANCELLATION] = "true"

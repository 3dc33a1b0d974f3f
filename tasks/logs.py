"""A refused spec reads as one line in a flow run's log, not as a traceback.

Prefect validates a flow run's parameters before the flow starts, fails the run, and then logs
"Engine execution exited with unexpected exception" with a traceback of its own engine, as for any
failed flow run. For a spec the server accepted but the flow refuses (a layout whose degrees do not
multiply to the chip count, a model that does not fit: rules across fields that JSON schema cannot
express), the user needs the spec error, as ``tessera validate`` prints it. This filter rewrites those
records of Prefect's flow-run and engine loggers to that one line; other failures keep their traceback.
"""

from __future__ import annotations

import logging

from prefect.exceptions import ParameterTypeError

PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.engine", "prefect.flows")


def spec_refusal(error: ParameterTypeError) -> str:
    """``spec is invalid: parallel: ...; train...``: Prefect's "Flow run received invalid parameters:"
    list (one ``- spec: Value error, ...`` line per error) as one line."""
    problems = [
        line.strip()
        .removeprefix("- ")
        .removeprefix("spec: ")
        .removeprefix("spec.")
        .replace("Value error, ", "")
        for line in str(error).splitlines()[1:]
        if line.strip()
    ]
    return "spec is invalid: " + "; ".join(problems)


class OneLineSpecRefusals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        refusal = record.exc_info[1] if record.exc_info else None
        refusal = refusal or next((a for a in record.args or () if isinstance(a, ParameterTypeError)), None)
        if isinstance(refusal, ParameterTypeError):
            record.msg, record.args = spec_refusal(refusal), ()
            record.exc_info, record.exc_text = None, None
        return True


def one_line_spec_refusals() -> None:
    """Install the filter on Prefect's flow-run loggers (once per process; idempotent)."""
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineSpecRefusals) for f in logger.filters):
            logger.addFilter(OneLineSpecRefusals())

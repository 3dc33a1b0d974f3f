"""Pre-flight planner: will a layout fit, how fast will it run, how often to checkpoint.

Pure Python over the config models (no torch import), so the CLI and spec validation stay fast.
"""

from trainer.plan.plan import (
    Plan,
    make_plan,
    plan_for_job,
    resolve_checkpoint_interval,
    resolve_memory_interval,
)
from trainer.plan.report import format_plan, format_search
from trainer.plan.search import fit_error, search_layouts

__all__ = [
    "Plan",
    "fit_error",
    "format_plan",
    "format_search",
    "make_plan",
    "plan_for_job",
    "resolve_checkpoint_interval",
    "resolve_memory_interval",
    "search_layouts",
]

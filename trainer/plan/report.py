"""Human-readable plans: rich tables for ``tessera plan`` and the Prefect report artifact."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from trainer.plan.plan import Plan


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _flops(n: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def format_plan(plan: Plan) -> Group:
    """Summary, per-chip memory and mesh placement tables."""
    mem = plan.memory_per_chip_bytes
    summary = Table(title=f"plan: {plan.layout} on {plan.chips} × {plan.chip}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [
        ("parameters", f"{plan.params / 1e9:,.3f} B"),
        (
            "fits",
            f"{'yes' if plan.fits else 'NO'} ({_gb(mem.total)} of {_gb(plan.usable_hbm_bytes)} usable, "
            f"{_gb(plan.hbm_bytes)} HBM)",
        ),
        ("tokens / step", f"{plan.tokens_per_step:,} (micro-batches per rank: {plan.microbatches})"),
        ("FLOPs / token (6N + 12Lsd)", _flops(plan.flops_per_token)),
        (
            "FLOPs / step (model; with recompute)",
            f"{_flops(plan.flops_per_step)}; {_flops(plan.hardware_flops_per_step)}",
        ),
        ("compute time", f"{plan.compute_time_s:,.3f} s at {plan.assumed_mfu:.0%} of peak"),
        ("pipeline bubble", f"{plan.bubble_fraction:.1%}"),
        (
            "communication",
            f"{_gb(plan.comm_bytes_per_step)} / step, {plan.comm_time_s:,.3f} s "
            f"({plan.exposed_comm_time_s:,.3f} s exposed)",
        ),
        ("step time", f"{plan.step_time_s:,.3f} s ({plan.tokens_per_second:,.0f} tokens/s)"),
        ("estimated MFU", f"{plan.mfu:.1%}"),
        (
            "checkpoint",
            f"{_gb(plan.checkpoint_bytes)}, write {plan.checkpoint_write_s:,.1f} s, "
            f"blocks {plan.checkpoint_blocking_s:,.2f} s",
        ),
        (
            "checkpoint interval (Young/Daly)",
            f"{plan.checkpoint_interval_steps:,} steps (MTBF {plan.mtbf_hours:,.1f} h)",
        ),
    ]
    for row in rows:
        summary.add_row(*row)

    memory = Table(title="memory per chip")
    for column in ("params", "grads", "optimizer", "activations", "buffers", "optimizer temp", "peak"):
        memory.add_column(column, justify="right")
    memory.add_row(
        *(
            _gb(x)
            for x in (
                mem.params,
                mem.grads,
                mem.optimizer,
                mem.activations,
                mem.buffers,
                mem.optimizer_temp,
                mem.total,
            )
        )
    )

    placement = Table(title="mesh placement (innermost first)")
    for column in ("dim", "degree", "domain", "link", "GB/s per chip", "bytes / step", "time / step"):
        placement.add_column(column, justify="right")
    for p in plan.placement:
        placement.add_row(
            p.dim,
            str(p.degree),
            p.domain,
            p.link,
            f"{p.bandwidth / 1e9:,.1f}",
            _gb(p.bytes_per_step),
            f"{p.time_s:,.3f} s",
        )
    return Group(summary, memory, placement)


def format_search(plans: list[Plan]) -> Table:
    table = Table(title="layouts that fit, fastest first")
    for column in ("#", "layout", "peak GB / chip", "step s", "MFU", "bubble"):
        table.add_column(column, justify="right")
    for rank, plan in enumerate(plans, 1):
        table.add_row(
            str(rank),
            plan.layout,
            f"{plan.memory_per_chip_bytes.total / 1e9:,.1f}",
            f"{plan.step_time_s:,.3f}",
            f"{plan.mfu:.1%}",
            f"{plan.bubble_fraction:.1%}",
        )
    return table

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


def _two_column_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def active_note(plan: Plan) -> str:
    """An MoE model's per-token share, which its FLOPs are counted from."""
    return f" ({plan.active_params / 1e9:,.3f} B active)" if plan.active_params != plan.params else ""


def summary_rows(plan: Plan) -> list[tuple[str, str]]:
    mem = plan.memory_per_chip_bytes
    return [
        ("parameters", f"{plan.params / 1e9:,.3f} B" + active_note(plan)),
        (
            "fits",
            f"{'yes' if plan.fits else 'NO'} ({_gb(mem.total)} of {_gb(plan.usable_hbm_bytes)} usable, "
            f"{_gb(plan.hbm_bytes)} HBM)",
        ),
        ("tokens / step", f"{plan.tokens_per_step:,} (micro-batches per rank: {plan.microbatches})"),
        ("FLOPs / token (6N + attention)", _flops(plan.flops_per_token)),
        (
            "FLOPs / step (model; with recompute)",
            f"{_flops(plan.flops_per_step)}; {_flops(plan.hardware_flops_per_step)}",
        ),
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
            "checkpoint storage needed",
            f"{_gb(plan.checkpoint_storage_bytes)} (keep_last + 1 checkpoints: old ones go after a commit)",
        ),
        (
            "checkpoint interval (Young/Daly)",
            f"{plan.checkpoint_interval_steps:,} steps (MTBF {plan.storage_mtbf_hours:,.1f} h)",
        ),
        (
            "in-memory snapshot interval (Young/Daly)",
            f"{plan.memory_interval_steps:,} steps (blocks {plan.memory_blocking_s:,.3f} s, peer send "
            f"{plan.peer_send_s:,.2f} s, MTBF {plan.mtbf_hours:,.1f} h)",
        ),
    ]


def time_table(plan: Plan) -> Table:
    """Where the step's seconds go (the parts sum to the step time), then each hardware figure's origin."""
    time = plan.time_breakdown
    table = Table(title="step time breakdown (slowest chip)")
    for column in ("part", "seconds", "share"):
        table.add_column(column, justify="right")
    parts = [
        ("compute (fwd + bwd)", time.compute_s - time.recompute_s),
        ("recompute (activation checkpointing)", time.recompute_s),
        *((f"exposed comm: {dim}", s) for dim, s in time.exposed_comm_s.items() if s > 0),
        ("pipeline bubble", time.bubble_s),
        ("optimizer step", time.optimizer_s),
    ]
    for name, seconds in parts:
        table.add_row(name, f"{seconds:,.4f}", f"{seconds / time.total_s:.1%}")
    table.add_row("step", f"{time.total_s:,.4f}", "100%", style="bold")
    return table


def sources_table(plan: Plan) -> Table:
    table = Table(title="hardware figures used")
    table.add_column("figure")
    table.add_column("source")
    for figure, source in plan.sources.items():
        table.add_row(figure, source)
    return table


def memory_table(plan: Plan) -> Table:
    mem = plan.memory_per_chip_bytes
    table = Table(title="memory per chip")
    columns = {
        "params": mem.params,
        "grads": mem.grads,
        "optimizer": mem.optimizer,
        "activations": mem.activations,
        "buffers": mem.buffers,
        "optimizer temp": mem.optimizer_temp,
        "peak": mem.total,
    }
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(*(_gb(x) for x in columns.values()))
    return table


def placement_table(plan: Plan) -> Table:
    table = Table(title="mesh placement (innermost first)")
    for column in ("dim", "degree", "domain", "link", "GB/s per chip", "α µs", "bytes / step", "time / step"):
        table.add_column(column, justify="right")
    for p in plan.placement:
        table.add_row(
            p.dim,
            str(p.degree),
            p.domain,
            p.link,
            f"{p.bandwidth / 1e9:,.1f}",
            f"{p.latency_s * 1e6:,.0f}",
            _gb(p.bytes_per_step),
            f"{p.time_s:,.3f} s",
        )
    return table


def format_plan(plan: Plan) -> Group:
    """Summary, step-time breakdown with its sources, per-chip memory and mesh placement tables."""
    summary = _two_column_table(f"plan: {plan.layout} on {plan.chips} × {plan.chip}", summary_rows(plan))
    return Group(summary, time_table(plan), sources_table(plan), memory_table(plan), placement_table(plan))


def format_search(plans: list[Plan]) -> Table:
    table = Table(title="layouts that fit, fastest first")
    for column in ("#", "layout", "peak GB / chip", "step s", "MFU", "bubble"):
        # A layout is applied as written: on a narrow terminal its words fold onto the next line, never cut.
        table.add_column(column, justify="right", overflow="fold" if column == "layout" else "ellipsis")
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

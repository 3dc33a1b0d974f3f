"""Goodput simulated over a long run: failures drawn from a failure model, each recovered by its path.

Event-driven: one event per failure, so a 54-day run on 16,384 chips (~420 failures) takes
milliseconds. Between failures the job trains at the planner's step time and stalls for each
checkpoint it saves; a failure loses every step since the newest copy its recovery path can read,
then costs detection, a relaunch of every worker, a replacement node when one was lost, and the
restore. Deterministic by seed (:class:`random.Random`).

Recovery paths (``DESIGN.md``, "Recovery tiers"):

* the processes die, the nodes survive (a software bug, an NCCL watchdog) → each rank's **own
  host memory**;
* a node is lost (GPU, HBM, host, switch, maintenance) → the lost ranks read their **peer's memory**
  on another node; the node is replaced by a **spare**, or the job **waits** for one to be repaired;
* the state itself is suspect (silent data corruption) → **storage**, and the node is replaced.

Under ``restart-all`` (tessera before the memory tier) every failure restores from storage.
The failure clock runs only while the job runs: a failure during a recovery is not modelled, nor are
the 47 planned interruptions of the Llama 3 snapshot (a planned stop checkpoints first: nothing lost).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from trainer.backends.chips import LLAMA3_FAILURES_PER_CHIP_HOUR, get_chip
from trainer.config import (
    CheckpointConfig,
    FaultsConfig,
    HardwareConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from trainer.plan.checkpointing import HOST_STAGING_BANDWIDTH
from trainer.plan.plan import Plan, make_plan

Lost = Literal["process", "node", "state"]  # what a failure takes with it
Detection = Literal["exit", "timeout"]  # a process exits at once; a hang waits out the collective timeout
Policy = Literal["two-tier", "restart-all"]
CATEGORIES = (
    "productive",
    "checkpoint",
    "memory_snapshot",
    "startup",
    "detection",
    "restart",
    "restore",
    "reschedule",
    "waiting",
    "recomputed",
)


@dataclass(frozen=True)
class FailureCategory:
    name: str
    count: int  # interruptions of this kind in the model's source
    lost: Lost
    detection: Detection = "exit"


@dataclass(frozen=True)
class FailureModel:
    """A per-chip failure rate split into categories (their counts give the shares)."""

    name: str
    failures_per_chip_hour: float
    categories: tuple[FailureCategory, ...]

    def job_rate_per_s(self, chips: int) -> float:
        return self.failures_per_chip_hour * chips / 3600


# Dubey et al. 2024 ("The Llama 3 Herd of Models"), Table 5: root causes of the 419 unexpected
# interruptions in 54 days of Llama 3 405B pre-training on 16,384 H100s. (The table prints 30.1% for
# the 148 faulty-GPU interruptions; 148/419 is 35.3%: the counts are used.) The lost/detection columns
# are ours: GPU and host faults take their node; network faults and NCCL timeouts hang until the
# collective timeout; software bugs crash the processes only; silent data corruption spoils the state.
LLAMA3_TABLE5 = FailureModel(
    "Llama 3 405B, Table 5 (419 unexpected interruptions, 54 days, 16,384 H100)",
    LLAMA3_FAILURES_PER_CHIP_HOUR,
    (
        FailureCategory("faulty GPU", 148, "node"),
        FailureCategory("GPU HBM3 memory", 72, "node"),
        FailureCategory("software bug", 54, "process"),
        FailureCategory("network switch/cable", 35, "node", "timeout"),
        FailureCategory("host maintenance (unplanned)", 32, "node"),
        FailureCategory("GPU SRAM memory", 19, "node"),
        FailureCategory("GPU system processor", 17, "node"),
        FailureCategory("NIC", 7, "node", "timeout"),
        FailureCategory("NCCL watchdog timeout", 7, "process", "timeout"),
        FailureCategory("silent data corruption", 6, "state"),
        FailureCategory("GPU thermal interface + sensor", 6, "node"),
        FailureCategory("SSD", 3, "node"),
        FailureCategory("power supply", 3, "node"),
        FailureCategory("server chassis", 2, "node"),
        FailureCategory("IO expansion board", 2, "node"),
        FailureCategory("dependency", 2, "process"),
        FailureCategory("CPU", 2, "node"),
        FailureCategory("system memory", 2, "node"),
    ),
)


@dataclass(frozen=True)
class Tier:
    """One checkpoint tier: its cadence, what a save blocks, how long until the copy is readable, restore."""

    interval_steps: int
    stall_s: float  # training blocked per save
    persist_s: float  # after the stall, until the copy can be restored from (async write, peer send)
    restore_s: float


@dataclass(frozen=True)
class Cluster:
    """Everything the simulation needs: step time, tiers, recovery costs, spares. All times in seconds."""

    chips: int
    step_s: float
    storage: Tier
    memory: Tier | None  # None: restart-all from storage
    peer_restore_s: float  # memory tier, node lost: read the peer's copy
    startup_s: float  # the first launch: processes, process groups, model build
    restart_s: float  # relaunch every worker after a failure (start-up again, without the queue)
    detect_exit_s: float  # a dead process noticed by the launcher
    detect_timeout_s: float  # a hang ended by the collective timeout
    reschedule_s: float  # a lost node replaced by a spare
    spare_nodes: int
    repair_s: float  # a lost node back in the spare pool


@dataclass
class Result:
    """Seconds per category (they sum to ``wall_s``), steps, failures by path, and a progress trace."""

    wall_s: float
    seconds: dict[str, float]
    steps_kept: int
    steps_lost: int
    failures: dict[str, int]
    step_s: float
    trace: list[tuple[float, int]] = field(default_factory=list)  # (wall s, steps kept), per recovery

    @property
    def effective_training_time(self) -> float:
        return self.seconds["productive"] / self.wall_s

    def as_dict(self) -> dict[str, object]:
        return {
            "effective_training_time": self.effective_training_time,
            "wall_s": self.wall_s,
            "steps_kept": self.steps_kept,
            "steps_lost": self.steps_lost,
            "failures": self.failures,
            "seconds": self.seconds,
            "fractions": {k: v / self.wall_s for k, v in self.seconds.items()},
        }


class _Segment:
    """Training from step ``start`` until the next failure: time per step count, saves, readable copies."""

    def __init__(self, cluster: Cluster, start: int) -> None:
        self.c, self.start = cluster, start

    def tiers(self) -> list[Tier]:
        return [t for t in (self.c.storage, self.c.memory) if t is not None]

    def elapsed(self, n: int) -> float:
        """Seconds for steps start+1 .. start+n, with the stalls of the saves among them."""
        saves = sum(
            t.stall_s * ((self.start + n) // t.interval_steps - self.start // t.interval_steps)
            for t in self.tiers()
        )
        return n * self.c.step_s + saves

    def steps_within(self, budget: float, limit: int) -> int:
        lo, hi = 0, limit
        while lo < hi:  # the largest n ≤ limit with elapsed(n) ≤ budget
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.elapsed(mid) <= budget else (lo, mid - 1)
        return lo

    def readable(self, tier: Tier, done: int, at: float, before: int) -> int:
        """The newest step of ``tier`` readable ``at`` seconds in, ``before`` if none was saved since."""
        step = (self.start + done) // tier.interval_steps * tier.interval_steps
        while step > self.start and self.elapsed(step - self.start) + tier.persist_s > at:
            step -= tier.interval_steps
        return max(step, before) if step > self.start else before

    def stalls(self, done: int) -> dict[str, float]:
        def count(t: Tier) -> int:
            return (self.start + done) // t.interval_steps - self.start // t.interval_steps

        memory = self.c.memory
        return {
            "checkpoint": self.c.storage.stall_s * count(self.c.storage),
            "memory_snapshot": memory.stall_s * count(memory) if memory else 0.0,
        }


def failure_draws(model: FailureModel, chips: int, seed: int) -> Iterator[tuple[float, FailureCategory]]:
    """Seconds of running until each next failure (exponential: a constant rate), and its category.
    A fault injector that draws from here with the simulator's seed replays its failures for real."""
    rng = random.Random(seed)
    rate = model.job_rate_per_s(chips)
    weights = [c.count for c in model.categories]
    while True:
        yield (rng.expovariate(rate) if rate > 0 else math.inf), rng.choices(model.categories, weights)[0]


def simulate(
    cluster: Cluster,
    model: FailureModel = LLAMA3_TABLE5,
    seed: int = 0,
    until_s: float = math.inf,
    until_steps: int | None = None,
) -> Result:
    """Run the job until ``until_s`` seconds of wall time or ``until_steps`` steps kept, whichever first."""
    if math.isinf(until_s) and until_steps is None:
        raise ValueError("give until_s or until_steps")
    draws = failure_draws(model, cluster.chips, seed)
    run = _Timeline(cluster)
    target = until_steps if until_steps is not None else math.inf
    while run.t < until_s and run.step < target:
        gap, category = next(draws)
        segment = _Segment(cluster, run.step)
        budget = min(gap, until_s - run.t)
        done = segment.steps_within(budget, int(min(target - run.step, budget / cluster.step_s + 1)))
        if budget < gap or run.step + done >= target:  # no failure before the end
            run.step = run.train(
                segment, done, segment.elapsed(done) if run.step + done >= target else budget
            )
            break
        run.fail(segment, done, gap, category)
    return Result(
        run.t, run.seconds, run.step, run.computed - run.step, run.failures, cluster.step_s, run.trace
    )


@dataclass
class _Timeline:
    """The simulated job as it goes: wall clock, seconds per category, steps, failures by path, trace."""

    cluster: Cluster
    t: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    failures: dict[str, int] = field(
        default_factory=lambda: {"own memory": 0, "peer memory": 0, "storage": 0, "spare": 0, "waited": 0}
    )
    repairs: list[float] = field(default_factory=list)  # when each node in repair returns to the spare pool
    trace: list[tuple[float, int]] = field(default_factory=list)
    step: int = 0  # kept
    stored: int = 0  # the newest step in storage
    snapped: int = 0  # the newest step in host memory
    computed: int = 0  # steps ever trained, kept or lost

    def __post_init__(self) -> None:
        self.t = self.seconds["startup"] = self.cluster.startup_s
        self.trace.append((self.t, 0))

    def spend(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        self.t += seconds

    def train(self, segment: _Segment, done: int, ran: float) -> int:
        """``done`` steps of ``segment`` over ``ran`` seconds, the rest of which went to a step cut off (by
        a failure or the horizon); returns the step reached."""
        for name, value in segment.stalls(done).items():
            self.seconds[name] += value
        self.seconds["productive"] += done * self.cluster.step_s
        self.seconds["recomputed"] += ran - segment.elapsed(done)
        self.computed += done
        self.t += ran
        self.trace.append((self.t, self.step + done))
        return self.step + done

    def fail(self, segment: _Segment, done: int, gap: float, category: FailureCategory) -> None:
        """A failure ``gap`` seconds into ``segment``: the steps since the copy it restores from are lost,
        then detection, a node replaced (unless only processes died), the relaunch and the restore."""
        c = self.cluster
        self.stored = segment.readable(c.storage, done, gap, self.stored)
        if c.memory is not None:
            self.snapped = segment.readable(c.memory, done, gap, max(self.snapped, self.step))
        reached = self.train(segment, done, gap)
        source, self.step, restore_s = _recovery_source(c, category.lost, self.snapped, self.stored, reached)
        self.failures[source] += 1
        lost = reached - self.step
        self.seconds["productive"] -= lost * c.step_s
        self.seconds["recomputed"] += lost * c.step_s
        self.spend("detection", c.detect_timeout_s if category.detection == "timeout" else c.detect_exit_s)
        if category.lost != "process":
            self.replace_node()
        self.seconds["restart"] += c.restart_s
        self.seconds["restore"] += restore_s
        self.t += c.restart_s + restore_s
        self.snapped = self.step  # the restored state is in every rank's memory again
        self.trace.append((self.t, self.step))

    def replace_node(self) -> None:
        """A spare takes the lost node's place, or, with more nodes out than spares, the job waits for the
        first one back from repair."""
        c = self.cluster
        while self.repairs and self.repairs[0] <= self.t:
            heapq.heappop(self.repairs)
        heapq.heappush(self.repairs, self.t + c.repair_s)  # the lost node goes to repair
        if len(self.repairs) > c.spare_nodes:
            self.spend("waiting", heapq.heappop(self.repairs) - self.t)
            self.failures["waited"] += 1
        else:
            self.failures["spare"] += 1
        self.spend("reschedule", c.reschedule_s)


def _recovery_source(
    cluster: Cluster, lost: Lost, snapped: int, stored: int, reached: int
) -> tuple[str, int, float]:
    """Where a failure's ranks restore from (the readable copy that costs least: restore time plus the
    steps to train again), its step, and how long the read takes."""
    options = [("storage", stored, cluster.storage.restore_s)]
    if cluster.memory is not None and lost != "state":
        memory_s = cluster.memory.restore_s if lost == "process" else cluster.peer_restore_s
        options.append(("own memory" if lost == "process" else "peer memory", snapped, memory_s))
    return min(options, key=lambda o: o[2] + (reached - o[1]) * cluster.step_s)


@dataclass(frozen=True)
class Assumptions:
    """Recovery costs the planner does not estimate. Defaults are assumed for a large GPU cluster; the CPU
    benchmark replaces them with this machine's measurements (``benchmarks/bench_goodput.py``)."""

    restart_s: float = 180.0  # relaunch 16K ranks: containers on cached images, import, rendezvous, NCCL init
    detect_exit_s: float = 10.0  # the launcher sees a worker exit; the peers' NCCL abort follows
    reschedule_s: float = 120.0  # a warm spare node (image pulled) takes the lost node's place in the gang
    spare_fraction: float = 0.02  # spare nodes per node of the job
    repair_s: float = 2 * 86400.0  # a lost node diagnosed, repaired and back in the spare pool


def planned_cluster(
    plan: Plan,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
    faults: FaultsConfig,
    assumptions: Assumptions = Assumptions(),
) -> Cluster:
    """The plan's step time, tiers and cadences as a :class:`Cluster`; without the memory tier when
    ``checkpoint.memory_interval`` is 'off'.

    Each rank holds ``checkpoint_bytes × dp_replicate / chips`` (its shard; replicas hold the same).
    Own memory restores it at the device↔host copy rate; a peer's memory first sends it over the
    chip's share of the inter-node links; storage reads each node's shards at ``write_bandwidth_gbps``
    per node (reads assumed as fast as writes), every replica its own copy.
    """
    chip = get_chip(hardware.chip)
    shard = plan.checkpoint_bytes * plan.parallel.dp_replicate / plan.chips
    to_device_s = shard / HOST_STAGING_BANDWIDTH
    async_write = checkpoint.mode != "sync"
    memory_on = checkpoint.memory_interval != "off"
    return Cluster(
        chips=plan.chips,
        step_s=plan.step_time_s,
        storage=Tier(
            plan.checkpoint_interval_steps,
            plan.checkpoint_blocking_s,
            plan.checkpoint_write_s - plan.checkpoint_blocking_s if async_write else 0.0,
            shard * hardware.chips_per_node / (checkpoint.write_bandwidth_gbps * 1e9),
        ),
        memory=Tier(
            checkpoint.memory_interval
            if isinstance(checkpoint.memory_interval, int)
            else plan.memory_interval_steps,
            plan.memory_blocking_s,
            plan.peer_send_s,
            to_device_s,
        )
        if memory_on
        else None,
        peer_restore_s=to_device_s + shard / chip.inter_bandwidth,
        startup_s=assumptions.restart_s,
        restart_s=assumptions.restart_s,
        detect_exit_s=assumptions.detect_exit_s,
        detect_timeout_s=faults.collective_timeout_s,
        reschedule_s=assumptions.reschedule_s,
        spare_nodes=math.ceil(assumptions.spare_fraction * hardware.nodes),
        repair_s=assumptions.repair_s,
    )


def policy_clusters(
    model: ModelConfig,
    parallel: ParallelConfig,
    train: TrainConfig,
    hardware: HardwareConfig,
    checkpoint: CheckpointConfig,
    faults: FaultsConfig,
    assumptions: Assumptions = Assumptions(),
) -> dict[str, Cluster]:
    """The spec's cluster planned twice: with both tiers (the memory interval as the spec sets it, the
    planner's when 'off' or 'auto'), and restart-all from storage (memory tier off, so the planner
    prices storage against every failure)."""
    memory = checkpoint.memory_interval if checkpoint.memory_interval != "off" else "auto"
    policies = {"two-tier": memory, "restart-all": "off"}
    clusters = {}
    for name, interval in policies.items():
        tiers = checkpoint.model_copy(update={"memory_interval": interval})
        plan = make_plan(model, parallel, train, hardware, tiers)
        clusters[name] = planned_cluster(plan, hardware, tiers, faults, assumptions)
    return clusters


def compare_policies(
    clusters: dict[str, Cluster],
    model: FailureModel = LLAMA3_TABLE5,
    seed: int = 0,
    until_s: float = 54 * 86400.0,
) -> dict[str, Result]:
    """Every policy's cluster on the same failure draws (same seed)."""
    return {name: simulate(cluster, model, seed, until_s) for name, cluster in clusters.items()}


def format_results(results: dict[str, Result]) -> str:
    """A text table: effective training time, steps lost, failures by recovery path, badput shares."""
    names = list(results)
    rows = [
        ("effective training time", [f"{r.effective_training_time:.2%}" for r in results.values()]),
        ("steps lost", [str(r.steps_lost) for r in results.values()]),
        *(
            (f"failures → {path}", [str(r.failures[path]) for r in results.values()])
            for path in next(iter(results.values())).failures
        ),
        *(
            (
                f"{category} (% wall)",
                [f"{100 * r.seconds[category] / r.wall_s:.2f}" for r in results.values()],
            )
            for category in CATEGORIES
        ),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'':<{width}}  " + "  ".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<{width}}  " + "  ".join(f"{v:>12}" for v in values) for label, values in rows]
    return "\n".join([*lines, "", choice(results)])


# Nearer than this (0.5 pp), the line warns that one seed's failures may decide the order: a judgement
# from the 405B example (95.34% vs 95.55%), not a measured spread over seeds.
CLOSE = 0.005


def choice(results: dict[str, Result]) -> str:
    """Which policy to choose (the most effective training time) and why: the badput categories where
    the runner-up loses most more of the wall clock, and those where it saves most, on the same failures."""
    best, *others = sorted(results, key=lambda n: results[n].effective_training_time, reverse=True)
    if not others:
        return f"{best}: {results[best].effective_training_time:.2%} effective training time"
    second = others[0]
    gap = {
        c: (
            results[second].seconds[c] / results[second].wall_s
            - results[best].seconds[c] / results[best].wall_s
        )
        for c in CATEGORIES
        if c != "productive"
    }
    ranked = sorted(gap, key=gap.__getitem__, reverse=True)
    costs = " and ".join(f"{c} (+{gap[c]:.2%})" for c in ranked[:2] if gap[c] > 0)
    saves = " and ".join(f"{c} (−{-gap[c]:.2%})" for c in ranked[::-1][:2] if gap[c] < 0)
    why = f"{second} loses more of the wall clock to {costs}" + (
        f" than it saves on {saves}" if saves else ""
    )
    line = (
        f"choose {best}: {results[best].effective_training_time:.2%} of the wall clock trains, against "
        f"{second}'s {results[second].effective_training_time:.2%}; {why}."
    )
    if results[best].effective_training_time - results[second].effective_training_time < CLOSE:
        line += " Both met the same failures (--seed); this close, another seed or --days may rank them otherwise."
    return line

"""A running plan's per-step CPU split re-made at the rate the host's CPU computes its experts in the steps.

A plan prices each CPU expert at calibrate's rate; inside the captured step the same host type's CPU ran them at
0.67-2.04x that price within a day (bench_hybrid, 2026-11-29, H200 hosts), the link's rate steady. Tables set for
one rate then keep the CPU busy past the link, or idle. So the runtime counts, every RESPLIT_WINDOW_STEPS decode
steps, what the host steps computed and how long they took (runtime.cpu_handoff.CpuExperts.work_by_layer, after the
steps queued have run: one synchronisation a window), prices those experts at the plan's rate, and where the host's
time over that price (the scale) is more than RESPLIT_TOLERANCE away from the scale the tables were made for, writes
every per-step layer's table made again at the measured scale (planner.search.cpu_resplit.resplit_at_scale; the
device tables in place, between replays: runtime.routed_experts.RoutedExperts.set_cpu_take). The resident experts,
the CPU ids and every buffer stay the plan's: its memory holds whatever the tables say.

A window whose steps computed fewer than RESPLIT_MIN_EXPERTS CPU experts is measured with the windows after it, until
they have as many (a table that sends the CPU little is measured over more steps). OFFLOAD_PLAN_CPU_RESPLIT=off keeps
the plan's tables. Plans with fixed CPU ids (no per-step layer) have nothing to re-split.
"""

from dataclasses import dataclass

from planner.search.cpu_resplit import RESPLIT_TOLERANCE, RESPLIT_WINDOW_STEPS, per_step_tables, resplit_at_scale
from runtime.cpu_handoff import env_choice

#: a window with fewer CPU experts than this measures no rate alone: the windows after it join it until they
#: hold as many
RESPLIT_MIN_EXPERTS = 8
#: a measured scale is clamped to this range of the plan's price (a host step stalled by something else for a
#: window, or a window counting a few cold experts, is not a rate to plan for)
RESPLIT_SCALE_RANGE = (0.25, 8.0)


@dataclass(frozen=True, kw_only=True)
class ResplitEvent:
    """One re-split: when, at what measured scale, and the step the plan's timeline gives with the new tables and
    with the plan's own at that scale."""

    #: decode steps observed before it
    step: int
    scale: float
    #: the scale the tables were made for before it (1.0: the plan's)
    previous_scale: float
    #: per-step layers whose table changed
    changed_layers: tuple[int, ...]
    step_ms: float
    planned_tables_step_ms: float

    def as_dict(self) -> dict:
        return {"step": self.step, "scale": round(self.scale, 4), "previous_scale": round(self.previous_scale, 4),
                "changed_layers": list(self.changed_layers), "step_ms": round(self.step_ms, 4),
                "planned_tables_step_ms": round(self.planned_tables_step_ms, 4)}


def _counters_reset(before: dict, now: dict) -> bool:
    """Whether the host steps' counters went back between two readings (run --bench's start_counting resets them):
    any layer's experts or seconds fewer than before."""
    return any(now.get(key, (0, 0.0))[0] < experts or now.get(key, (0, 0.0))[1] < seconds
               for key, (experts, seconds) in before.items())


def resplit_enabled() -> bool:
    """OFFLOAD_PLAN_CPU_RESPLIT: "on" (the default) or "off" (the plan's tables throughout); one line otherwise."""
    return env_choice("OFFLOAD_PLAN_CPU_RESPLIT", ("on", "off")) == "on"


class CpuResplitter:
    """Watches a running plan's CPU experts and re-splits its per-step tables at the host's measured rate."""

    def __init__(self, plan, routed, window_steps: int = RESPLIT_WINDOW_STEPS):
        self.plan, self.routed, self.window_steps = plan, routed, window_steps
        #: routed layer index -> the plan's price of one CPU expert, ms (None: the Python host function's layers
        #: together, at their mean)
        self.prices: dict[int | None, float] = {row.index: row.cpu_ms_per_expert
                                                for row in plan.experts.cpu_layers}
        self.prices[None] = sum(self.prices.values()) / len(self.prices)
        #: the scale the device tables are made for (1.0: the plan's own)
        self.scale = 1.0
        self.steps_seen = 0
        self.history: list[ResplitEvent] = []
        #: the scale each window measured (None: too few CPU experts), in order
        self.measured: list[float | None] = []
        self._since_window = 0
        self._baseline: dict | None = None

    def observe(self, num_steps: int) -> ResplitEvent | None:
        """Count ``num_steps`` decode steps just queued; at each window's end, measure and re-split where due."""
        self.steps_seen += num_steps
        self._since_window += num_steps
        if self._since_window < self.window_steps:
            return None
        self._since_window = 0
        return self.window_end()

    def restart(self) -> None:
        """Start the next window from now (the counters were reset, or the steps before were not decode's)."""
        self._since_window, self._baseline = 0, None

    def window_end(self) -> ResplitEvent | None:
        """Measure the window just ended (the first after a restart only sets the baseline) and re-split where the
        scale moved past RESPLIT_TOLERANCE. A window with too few CPU experts keeps its baseline: the next windows
        add theirs to it until there are enough (a table that sends the CPU little is still measured, over more
        steps)."""
        now = self.routed.cpu_experts.work_by_layer()
        before = self._baseline
        if before is None or _counters_reset(before, now):
            self._baseline = now
            return None
        scale = self._window_scale(before, now)
        self.measured.append(scale)
        if scale is None:
            return None
        self._baseline = now
        if abs(scale / self.scale - 1.0) <= RESPLIT_TOLERANCE:
            return None
        return self.resplit(scale)

    def _window_scale(self, before: dict, now: dict) -> float | None:
        """The host's seconds over the plan's price of the experts it computed between two readings (None: too few
        experts)."""
        experts = {key: now[key][0] - before.get(key, (0, 0.0))[0] for key in now}
        seconds = {key: now[key][1] - before.get(key, (0, 0.0))[1] for key in now}
        if sum(experts.values()) < RESPLIT_MIN_EXPERTS:
            return None
        priced_ms = sum(count * self.prices.get(key, self.prices[None]) for key, count in experts.items())
        low, high = RESPLIT_SCALE_RANGE
        return min(max(1e3 * sum(seconds.values()) / priced_ms, low), high)

    def resplit(self, scale: float) -> ResplitEvent | None:
        """Make and write the per-step tables at ``scale``; the event (None where the plan has no per-step table)."""
        made = resplit_at_scale(self.plan, scale)
        if made is None:
            return None
        changed = tuple(index for index, take in made.tables.items() if take != self.routed.cpu_take.get(index))
        if changed:
            self.routed.set_cpu_take({index: made.tables[index] for index in changed})
        event = ResplitEvent(step=self.steps_seen, scale=scale, previous_scale=self.scale, changed_layers=changed,
                             step_ms=made.step_ms, planned_tables_step_ms=made.planned_tables_step_ms)
        self.scale = scale
        self.history.append(event)
        return event


def resplitter_for(plan, routed) -> CpuResplitter | None:
    """The re-splitter of a started plan's routed experts: None where the plan has no per-step CPU layer priced per
    expert, or OFFLOAD_PLAN_CPU_RESPLIT=off."""
    if routed is None or routed.cpu_experts is None or not per_step_tables(plan) or not resplit_enabled():
        return None
    if any(row.cpu_ms_per_expert is None for row in plan.experts.cpu_layers):
        return None
    return CpuResplitter(plan, routed)


#: windows of decode steps a bench runs before its timed steps where the plan re-splits: the first sets the
#: baseline, the second measures and re-splits, the third measures the new tables (and re-splits again if due)
RESPLIT_SETTLE_WINDOWS = 3


def settle(loop) -> None:
    """Before a bench's timed steps (runtime.graph.DecodeLoop ``loop``): RESPLIT_SETTLE_WINDOWS windows of decode
    steps, so the timed steps run on tables set for this host's rate; the cache is put back as it was (the steps
    take none of the room past the context the timed steps need). Nothing where the loop has no re-splitter."""
    resplit = loop.resplit
    if resplit is None:
        return
    saved = loop.save_state()
    resplit.restart()
    loop.timed_steps(RESPLIT_SETTLE_WINDOWS * resplit.window_steps)
    loop.restore_state(saved)

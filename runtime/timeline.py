"""What the link and the SMs did during some decode steps, read from a torch.profiler (Kineto) trace.

Used by scripts/experiments/trace_decode.py to compare an eager offloaded step with the same step replayed from a
CUDA graph: is the graphed step slower because each host-to-device copy moves bytes slower (copy busy time grows),
or because copies start later (the link sits idle between them, and the SMs were busy then)?
"""

from __future__ import annotations

from dataclasses import dataclass

#: host-to-device copies smaller than this are ids and counters, not offloaded weights
MIN_WEIGHT_COPY_BYTES = 1_000_000
#: idle stretches of the link shorter than this are the copy engine's own turnaround, not a late start
MIN_GAP_US = 20.0


@dataclass(frozen=True)
class Interval:
    start_us: float
    end_us: float

    @property
    def length_us(self) -> float:
        return self.end_us - self.start_us


@dataclass(frozen=True)
class LinkSummary:
    """Per decode step, in ms, over the traced window."""

    step_ms: float
    copies_per_step: float
    copy_busy_ms: float
    link_idle_ms: float
    copy_gb_per_s: float
    kernel_busy_ms: float
    #: kernel time while the link sat idle between weight copies: compute the copies waited behind
    kernel_in_gaps_ms: float
    #: gaps longer than MIN_GAP_US, and the longest, in ms
    num_gaps_per_step: float
    longest_gap_ms: float


def weight_copies(events: list[dict]) -> tuple[list[Interval], int]:
    """(intervals, bytes) of the host-to-device weight copies in a Chrome-trace event list."""
    intervals, total_bytes = [], 0
    for event in events:
        if event.get("cat") != "gpu_memcpy" or "HtoD" not in event.get("name", ""):
            continue
        num_bytes = int(event.get("args", {}).get("bytes", 0))
        if num_bytes >= MIN_WEIGHT_COPY_BYTES:
            intervals.append(Interval(float(event["ts"]), float(event["ts"]) + float(event["dur"])))
            total_bytes += num_bytes
    return sorted(intervals, key=lambda i: i.start_us), total_bytes


def kernels(events: list[dict]) -> list[Interval]:
    """The GPU kernels of a Chrome-trace event list, by start time."""
    found = [Interval(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") == "kernel"]
    return sorted(found, key=lambda i: i.start_us)


def merged(intervals: list[Interval]) -> list[Interval]:
    """The union of intervals (sorted by start) as disjoint intervals: kernels on several streams overlap."""
    out: list[Interval] = []
    for interval in intervals:
        if out and interval.start_us <= out[-1].end_us:
            out[-1] = Interval(out[-1].start_us, max(out[-1].end_us, interval.end_us))
        else:
            out.append(interval)
    return out


def covered_us(busy: list[Interval], window: Interval) -> float:
    """Microseconds of ``window`` that the disjoint intervals ``busy`` cover."""
    return sum(max(0.0, min(b.end_us, window.end_us) - max(b.start_us, window.start_us)) for b in busy)


def link_gaps(copies: list[Interval]) -> list[Interval]:
    """Stretches between consecutive weight copies longer than MIN_GAP_US."""
    gaps = [Interval(a.end_us, b.start_us) for a, b in zip(copies, copies[1:])]
    return [gap for gap in gaps if gap.length_us > MIN_GAP_US]


def summarize(events: list[dict], num_steps: int) -> LinkSummary:
    """The link and SM figures per step of a trace covering ``num_steps`` decode steps."""
    copies, copy_bytes = weight_copies(events)
    if not copies:
        raise ValueError("the trace holds no host-to-device weight copies")
    busy_kernels = merged(kernels(events))
    starts = [copies[0].start_us] + [k.start_us for k in busy_kernels]
    ends = [copies[-1].end_us] + [k.end_us for k in busy_kernels]
    window_us = max(ends) - min(starts)
    copy_us = sum(c.length_us for c in copies)
    gaps = link_gaps(copies)
    per_step = 1e-3 / num_steps
    return LinkSummary(
        step_ms=window_us * per_step,
        copies_per_step=len(copies) / num_steps,
        copy_busy_ms=copy_us * per_step,
        link_idle_ms=sum(g.length_us for g in gaps) * per_step,
        copy_gb_per_s=copy_bytes / copy_us / 1e3,
        kernel_busy_ms=sum(k.length_us for k in busy_kernels) * per_step,
        kernel_in_gaps_ms=sum(covered_us(busy_kernels, g) for g in gaps) * per_step,
        num_gaps_per_step=len(gaps) / num_steps,
        longest_gap_ms=max((g.length_us for g in gaps), default=0.0) / 1e3,
    )

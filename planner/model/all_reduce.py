"""What tensor parallelism's all-reduces cost: the link between the ranks (latency and bus bandwidth, from the
profile or measured by make --measure through runtime.all_reduce), a ring all-reduce and a gather over it, and
the all-reduces of one step added to a rank's compute.

A ring all-reduce moves 2 (N - 1) / N of the bytes over each GPU's link (nccl-tests' "bus bandwidth", in
NVIDIA/nccl-tests' doc/PERFORMANCE.md); a gather (N - 1) / N. Pure: no torch.
"""

from dataclasses import dataclass

from planner.errors import ProfileError, UsageError
from planner.model.cost import ComputeTimes
from planner.model.model_config import DTYPE_BYTES, model_config
from planner.model.tensor_parallel import RankCheckpoint, pad_vocab
from planner.source.checkpoint import Checkpoint

#: fixed cost of one all-reduce on NVLink, on top of bytes / bandwidth, where make cannot measure it: what run's
#: all-reduce (torch's NCCL, as runtime.all_reduce times it) measured for a decode-sized message between two
#: H200s, 23.2 and 29.1 us on 2026-11-26 and 45.6 us on 2026-11-29 (benchmarks/2026-11-26-tp-2xh200.md,
#: 2026-11-29-conformance-tp-2xh200.md), rounded to the middle of those. The 10 us assumed before (the order of
#: nccl-tests' small-message latency within an NVLink node, and of vLLM's custom one-shot all-reduce) left
#: estimated rank steps 4-58% optimistic. make --tp N --measure measures it where N GPUs are visible
ALL_REDUCE_LATENCY_US = 30.0
#: all-reduces per decoder layer: after attention's row-parallel o_proj and after the MLP's down_proj. A MoE
#: layer reduces once too: vLLM's FusedMoE reduces the routed experts' partial sums (reduce_results), and where
#: there are shared experts (DeepSeek) SharedFusedMoE adds their partial output before that one reduce; transformers'
#: Qwen3-MoE tp_plan ("moe_tp_experts") likewise reduces once after the experts
ALL_REDUCES_PER_LAYER = 2



@dataclass(frozen=True, kw_only=True)
class AllReduceLink:
    """What one all-reduce costs between the ranks: a fixed latency plus bytes over a bus bandwidth."""

    latency_us: float
    #: bytes per second of the ring's traffic (nccl-tests' "bus bandwidth": 2 (N - 1) / N of the bytes cross each
    #: GPU's link)
    bytes_per_s: float
    #: "measured: ..." where timed on the local GPUs, "" for the profile's figure and the assumed latency
    measured: str = ""
    #: why an assumed figure stands where --measure asked for a measured one ("" otherwise)
    assumed_why: str = ""
    #: GPU memory NCCL held outside torch's allocator on a rank once it joined the group and reduced (measured
    #: beside the timings; None where not measured)
    nccl_bytes: int | None = None

    def describe(self, tp: int, num_per_step: int) -> str:
        """How the plan's compute source states the all-reduces (unchanged for a plan without --measure)."""
        text = (f"+ {num_per_step} all-reduces a step over {tp} GPUs at {self.bytes_per_s / 1e9:g} GB/s and "
                f"{self.latency_us:g} us each")
        if self.measured:
            return f"{text} ({self.measured})"
        if self.assumed_why:
            return f"{text} (assumed: the profile's link and {ALL_REDUCE_LATENCY_US:g} us; {self.assumed_why})"
        return text


def assumed_link(profile, tp: int, why: str = "") -> AllReduceLink:
    """The profile's gpu_link_bytes_per_s and the assumed latency (``why``: why no measured figure stands)."""
    return AllReduceLink(latency_us=ALL_REDUCE_LATENCY_US, bytes_per_s=link_bytes_per_s(profile, tp),
                         assumed_why=why)


def link_from_timings(tp: int, timings: tuple[tuple[int, float], ...], measured: str,
                      nccl_bytes: int | None = None) -> AllReduceLink:
    """The latency and bus bandwidth through the smallest and the largest of ``timings`` ((message bytes, ms of one
    all-reduce) on ``tp`` GPUs): the line t = latency + 2 (N - 1) / N x bytes / bandwidth through both."""
    if tp < 2 or len(timings) < 2:
        raise UsageError(f"an all-reduce link needs timings of two message sizes on 2 GPUs or more (got "
                         f"{len(timings)} on {tp})")
    (small_bytes, small_ms), (large_bytes, large_ms) = min(timings), max(timings)
    if large_bytes <= small_bytes or large_ms <= small_ms:
        raise UsageError(f"the all-reduce of {large_bytes} bytes took {large_ms:.4f} ms, no longer than "
                         f"{small_bytes} bytes ({small_ms:.4f} ms): the timing is noise; measure again on idle GPUs")
    ms_per_byte = (large_ms - small_ms) / (large_bytes - small_bytes)
    latency_ms = max(0.0, small_ms - ms_per_byte * small_bytes)
    bus_bytes_per_s = 1e3 * 2 * (tp - 1) / tp / ms_per_byte
    return AllReduceLink(latency_us=round(1e3 * latency_ms, 2), bytes_per_s=round(bus_bytes_per_s, -7),
                         measured=measured, nccl_bytes=nccl_bytes)


def ring_all_reduce_ms(num_bytes: float, tp: int, link_bytes_per_s: float,
                       latency_us: float = ALL_REDUCE_LATENCY_US) -> float:
    """One all-reduce of ``num_bytes`` over ``tp`` GPUs: a ring moves 2 (N - 1) / N of the bytes over each GPU's
    link, plus a fixed latency; 0 on one GPU."""
    if tp == 1:
        return 0.0
    return latency_us / 1e3 + 1e3 * 2 * (tp - 1) / tp * num_bytes / link_bytes_per_s


def gather_ms(num_bytes: float, tp: int, link_bytes_per_s: float, latency_us: float = ALL_REDUCE_LATENCY_US) -> float:
    """One gather of ``num_bytes`` in all (the LM head's logits): (N - 1) / N of them cross the link."""
    if tp == 1:
        return 0.0
    return latency_us / 1e3 + 1e3 * (tp - 1) / tp * num_bytes / link_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class AllReduces:
    """What tensor parallelism adds to one step's compute."""

    #: added to each decoder layer: its two all-reduces
    layer_ms: float
    #: added to the work outside the stack: the embedding's all-reduce and the logits' gather
    head_ms: float
    num_per_step: int


def step_all_reduces(*, tp: int, num_layers: int, tokens_per_step: int, sequences_per_step: int, hidden_size: int,
                     vocab_size: int, activation_bytes: int, link_bytes_per_s: float,
                     latency_us: float = ALL_REDUCE_LATENCY_US) -> AllReduces:
    """The all-reduces of one step: two per layer over the step's hidden states, one for the embedding, and the
    LM head's gather of the last token's logits of each sequence."""
    hidden_bytes = tokens_per_step * hidden_size * activation_bytes
    layer_ms = ALL_REDUCES_PER_LAYER * ring_all_reduce_ms(hidden_bytes, tp, link_bytes_per_s, latency_us)
    logits_bytes = sequences_per_step * pad_vocab(vocab_size) * activation_bytes
    head_ms = (ring_all_reduce_ms(hidden_bytes, tp, link_bytes_per_s, latency_us)
               + gather_ms(logits_bytes, tp, link_bytes_per_s, latency_us))
    return AllReduces(layer_ms=layer_ms, head_ms=head_ms,
                      num_per_step=0 if tp == 1 else ALL_REDUCES_PER_LAYER * num_layers + 2)


def link_bytes_per_s(profile, tp: int) -> float:
    """The profile's GPU-to-GPU bandwidth per direction; a one-line error where a TP plan needs one and it has none."""
    figure = getattr(profile, "gpu_link_bytes_per_s", None)
    if figure is None:
        if tp > 1:
            raise ProfileError(f"--tp {tp}: profile {profile.name} has no gpu_link_bytes_per_s (the GPU-to-GPU "
                               "bandwidth the all-reduces cross); add it to the profile, as profiles/h100-sxm.yaml "
                               "has, or plan with --tp 1")
        return 0.0
    return figure.value


def with_all_reduces(compute: ComputeTimes, checkpoint: Checkpoint, workload, profile,
                     link: AllReduceLink | None = None) -> ComputeTimes:
    """``compute`` of one rank with the step's all-reduces added to each layer and to the head, at ``link`` (default:
    the profile's figure and the assumed latency); a checkpoint that is not a RankCheckpoint comes back as it is."""
    if not isinstance(checkpoint, RankCheckpoint):
        return compute
    link = assumed_link(profile, checkpoint.tp_size) if link is None else link
    record = model_config(checkpoint.whole_config)
    hidden, vocab, dtype = (record.hidden_size, record.vocab_size, record.dtype) if record else (None, None, None)
    reduces = step_all_reduces(
        tp=checkpoint.tp_size, num_layers=len(compute.layer_ms), tokens_per_step=workload.tokens_per_step,
        sequences_per_step=workload.sequences_per_step, hidden_size=hidden or 0,
        vocab_size=vocab or 0, activation_bytes=DTYPE_BYTES.get(dtype, 2),
        link_bytes_per_s=link.bytes_per_s, latency_us=link.latency_us)
    return ComputeTimes(layer_ms=tuple(ms + reduces.layer_ms for ms in compute.layer_ms),
                        head_ms=compute.head_ms + reduces.head_ms,
                        source=f"{compute.source}; {link.describe(checkpoint.tp_size, reduces.num_per_step)}")
